"""Interleaved A/B of decode (T=1) and verify (T=8) step variants on `synthetic:qwen3.6-27b` (8k-speed formats,
row-major q5/q4, int8 KV, 8K context), against the engine's steps; one process, the same weights, CUDA graphs for
each variant, timed in alternating rounds (a machine drifts ~0.1 ms between back-to-back runs, lab notes (23)).
Each variant is captured `--captures` times, each capture on a cache of its own: one capture's graphs and
allocation shift its step by as much as ~0.07 ms (lab notes (25)), so a variant's figure is the median over its
captures, and the spread between the engine's own captures is printed as the noise a difference must exceed.
The variant kept: the GDN output gate in a norm launch of its own instead of the GDN step kernel (the engine's
since (23) at T=1: -0.048 ms on the H200, results/ab_gdn_gate_NVIDIA_H200.json, from this script's earlier form);
it touches only the T=1 step, so its T=8 figure measures the method's spread too. "no PDL": every step kernel
launched without programmatic dependent launch (the engine's on sm_90 and newer since (28); the same as
NINFER_PDL=0). A new variant is a `Variant` field that `configure` sets before a capture, by patching the module
it changes from here: the engine keeps no switch for it. (Earlier variants, removed: matmuls asking L2 for the
next matmul's weights, refuted in (25); the GDN conv step in the in_proj matmul's programs, not separable from
noise in (25) and failing its GPU test in (26); "PDL, no L2 prefetch" and "tiled matmuls without PDL", measured
in (28) and (29), whose switches left the kernels once their results were in.)

Usage: python scripts/experiments/ab_step.py [--rounds 6 --reps 25 --captures 3] [--only NAME ...]
  [--weights "q5/q4 tiles"] -> table + scripts/results/ab_step_<gpu>.json
"""
from __future__ import annotations

import argparse
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
sys.path[:0] = [str(ROOT), str(HERE.parent)]  # the engine, and the benchmarks' helpers in scripts/

from bench_decode import MIXES, time_step  # noqa: E402
from bench_util import fill_cache, gpu_name, write_results  # noqa: E402

from engine import Engine, EngineConfig  # noqa: E402
from engine.kernels import pdl  # noqa: E402
from engine.models import qwen3_5  # noqa: E402
from engine.runtime.lanes import Lanes  # noqa: E402
from engine.runtime.runner import GraphRunner  # noqa: E402

CONTEXT = 8192
STEPS = (1, 8)  # decode, and a K=7 verify step
OUTPUT_GATE = qwen3_5.output_gate
PDL = pdl.ENABLED


@dataclass(frozen=True)
class Variant:
    name: str
    gate_in_gdn: bool = True  # the output gate applied by the GDN step kernel (the engine's)
    pdl_on: bool = PDL  # programmatic dependent launch where the GPU has it (the engine's unless NINFER_PDL=0)


VARIANTS = (Variant("engine"), Variant("gate in its own norm launch", gate_in_gdn=False),
            Variant("no PDL", pdl_on=False))


def configure(v: Variant) -> None:
    """Patch what a step captured now runs (the graph keeps what ran then)."""
    qwen3_5.output_gate = OUTPUT_GATE if v.gate_in_gdn else (lambda *a, **k: None)
    pdl.ENABLED = v.pdl_on


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--reps", type=int, default=25)
    p.add_argument("--captures", type=int, default=3, help="captures of each variant, each on its own cache")
    p.add_argument("--only", nargs="+", default=None, help="variant names to time beside the engine's")
    p.add_argument("--weights", choices=list(MIXES), default="q5/q4 mix",
                   help="q5/q4 tiles: the CUDA matmuls' layout (the engine's with a drafter or concurrent requests)")
    args = p.parse_args()
    formats, layout = MIXES[args.weights]
    eng = Engine(EngineConfig("synthetic:qwen3.6-27b", device="cuda", weights=formats, weight_layout=layout,
                              max_context=16, kv_dtype="int8", held_sequences=0, cuda_graphs=False))
    variants = [v for v in VARIANTS if not args.only or v.name == "engine" or v.name in args.only]
    captured = []  # (variant name, capture, runner, cache)
    for c in range(args.captures):  # each variant's captures spread over the allocation order
        for v in variants:
            configure(v)
            cache = eng.model.new_cache(CONTEXT + 16)
            runner = GraphRunner(eng.model, Lanes([cache]), STEPS)
            runner.capture_all()
            fill_cache(cache, CONTEXT)
            captured.append((v.name, c, runner, cache))
    configure(VARIANTS[0])
    rows = []
    for r in range(args.rounds):
        for name, c, runner, cache in captured:
            for t in STEPS:
                rows.append({"gpu": gpu_name(), "model": "synthetic:qwen3.6-27b", "weights": args.weights,
                             "kv_dtype": "int8", "context": CONTEXT, "T": t, "variant": name, "capture": c,
                             "round": r, "ms_per_step": time_step(runner, cache, t, args.reps)})
    print(f"{'variant':<30} {'T':>2} {'median ms':>10} {'captures min':>13} {'max':>8} {'- engine':>9}")
    summary = []
    for t in STEPS:
        for v in variants:
            ms = [x["ms_per_step"] for x in rows if x["variant"] == v.name and x["T"] == t]
            per_capture = [statistics.median(x["ms_per_step"] for x in rows if x["variant"] == v.name
                                             and x["T"] == t and x["capture"] == c) for c in range(args.captures)]
            summary.append({"variant": v.name, "T": t, "median_ms": statistics.median(ms),
                            "capture_medians_ms": per_capture})
            base = next(s["median_ms"] for s in summary if s["T"] == t)  # the engine's, first
            print(f"{v.name:<30} {t:>2} {summary[-1]['median_ms']:>10.3f} {min(per_capture):>13.3f} "
                  f"{max(per_capture):>8.3f} {summary[-1]['median_ms'] - base:>+9.3f}")
    print(f"({args.captures} captures per variant, {args.rounds} alternating rounds of {args.reps} replays per "
          "capture and step; a difference smaller than the engine's own captures' spread is noise)")
    print(f"wrote {write_results('ab_step', {'summary': summary, 'rows': rows})}")

if __name__ == "__main__":
    main()
