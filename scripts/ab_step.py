"""Interleaved A/B of decode (T=1) and verify (T=8) step variants on `synthetic:qwen3.6-27b` (8k-speed formats,
row-major q5/q4, int8 KV, 8K context), against the engine's steps; one process, the same weights, CUDA graphs for
each variant, timed in alternating rounds (a machine drifts ~0.1 ms between back-to-back runs, NOTES.md (23)).
The variants:
- the GDN output gate in a norm launch of its own instead of the GDN step kernel (the engine's since (23) at T=1:
  -0.048 ms on the H200, results/ab_gdn_gate_NVIDIA_H200.json, from this script's earlier form);
- the GDN conv step in the in_proj matmul's programs at T=1 (`qwen3_5.CONV_IN_PROJ`: 48 launches fewer; NOTES.md
  (24));
- matmuls that ask L2 for the next matmul's codes (`kernels/prefetch.py`, NOTES.md (24); the next one in the
  step's order, the lm head's next being layer 0's first): in a launch after the matmul (~1.5 us per launch in a
  graph) or by the matmul's own programs as they end (v7 with PF, no launch: T=1; the verify step's kernels take
  the launch); in each way only where the next weight fits in half the L2 whole (the GDN and attention out
  projections, 2.4x their read time on the H200 at T=1: the conv and GDN step or the attention run between them
  and the matmul before), or after every matmul (its first L2/2 bytes).
The T=1-only variants (gate, conv) time the engine's T=8 step again: a check on the alternation's spread. The last
two are off the engine's path until measured.

Usage: python scripts/ab_step.py [--rounds 8 --reps 30] [--only NAME ...] -> table +
  scripts/results/ab_step_<gpu>.json
"""
from __future__ import annotations

import argparse
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench_decode import MIXES, time_step  # noqa: E402
from bench_util import fill_cache, gpu_name, write_results  # noqa: E402

from engine import Engine, EngineConfig  # noqa: E402
from engine.kernels import qmatmul  # noqa: E402
from engine.models import qwen3_5  # noqa: E402
from engine.runtime.lanes import Lanes  # noqa: E402
from engine.runtime.runner import GraphRunner  # noqa: E402

CONTEXT = 8192
STEPS = (1, 8)  # decode, and a K=7 verify step
OUTPUT_GATE = qwen3_5.output_gate


def decode_order(model, cache) -> list:
    """The quantized weights a T=1 step multiplies, in the order it launches them (one eager step)."""
    seen, launch = [], qmatmul.qlinear

    def recording(x, w, partial=False):
        seen.append(w)
        return launch(x, w, partial)

    qmatmul.qlinear = recording
    try:
        with torch.inference_mode():
            model.forward(torch.zeros(1, dtype=torch.long, device="cuda"), cache)
    finally:
        qmatmul.qlinear = launch
    cache.length = 0
    return seen


@dataclass(frozen=True)
class Variant:
    name: str
    gate_in_gdn: bool = True  # the output gate applied by the GDN step kernel (the engine's)
    conv_in_proj: bool = False
    prefetch: str = ""  # "": none; "out": where the next weight fits PREFETCH_BYTES whole; "every"
    tail: bool = False  # the prefetch asked by v7's programs as they end rather than a launch


VARIANTS = (Variant("engine"), Variant("gate in its own norm launch", gate_in_gdn=False),
            Variant("conv in in_proj", conv_in_proj=True),
            Variant("prefetch launch, out projs", prefetch="out"),
            Variant("prefetch launch, every matmul", prefetch="every"),
            Variant("prefetch tail, out projs", prefetch="out", tail=True),
            Variant("prefetch tail, every matmul", prefetch="every", tail=True))


def configure(v: Variant, order: list) -> None:
    """Set the module switches a step captured now reads (the graph keeps what ran then)."""
    qwen3_5.output_gate = OUTPUT_GATE if v.gate_in_gdn else (lambda *a, **k: None)
    qwen3_5.CONV_IN_PROJ, qmatmul.PREFETCH_IN_TAIL = v.conv_in_proj, v.tail
    for w, nxt in zip(order, order[1:] + order[:1], strict=True):
        fits = nxt.codes.nbytes <= qmatmul.PREFETCH_BYTES
        w.prefetch = nxt.codes if v.prefetch == "every" or (v.prefetch == "out" and fits) else None


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--reps", type=int, default=30)
    p.add_argument("--only", nargs="+", default=None, help="variant names to time beside the engine's")
    args = p.parse_args()
    formats, layout = MIXES["q5/q4 mix"]
    eng = Engine(EngineConfig("synthetic:qwen3.6-27b", device="cuda", weights=formats, weight_layout=layout,
                              max_context=16, kv_dtype="int8", held_sequences=0, cuda_graphs=False))
    cache = eng.model.new_cache(CONTEXT + 16)
    order = decode_order(eng.model, cache)
    print(f"{len(order)} matmuls per T=1 step")
    qmatmul.PREFETCH_BYTES = torch.cuda.get_device_properties(0).L2_cache_size // 2
    variants = {}
    for v in VARIANTS:
        if args.only and v.name != "engine" and v.name not in args.only:
            continue
        configure(v, order)
        print(f"{v.name}: {sum(w.prefetch is not None for w in order)} matmuls prefetch")
        cache = eng.model.new_cache(CONTEXT + 16)
        runner = GraphRunner(eng.model, Lanes([cache]), STEPS)
        runner.capture_all()
        fill_cache(cache, CONTEXT)
        variants[v.name] = (runner, cache)
    configure(VARIANTS[0], order)
    rows = []
    for r in range(args.rounds):
        for name, (runner, cache) in variants.items():
            for t in STEPS:
                rows.append({"gpu": gpu_name(), "model": "synthetic:qwen3.6-27b", "weights": "q5/q4 mix",
                             "kv_dtype": "int8", "context": CONTEXT, "T": t, "variant": name, "round": r,
                             "ms_per_step": time_step(runner, cache, t, args.reps)})
    print(f"{'variant':<30} {'T':>2} {'median ms':>10} {'min':>8} {'max':>8} {'- engine':>9}")
    summary = []
    for t in STEPS:
        for name in variants:
            ms = [x["ms_per_step"] for x in rows if x["variant"] == name and x["T"] == t]
            summary.append({"variant": name, "T": t, "median_ms": statistics.median(ms), "min_ms": min(ms),
                            "max_ms": max(ms)})
            base = next(s["median_ms"] for s in summary if s["T"] == t)  # the engine's, timed first
            print(f"{name:<30} {t:>2} {summary[-1]['median_ms']:>10.3f} {min(ms):>8.3f} {max(ms):>8.3f} "
                  f"{summary[-1]['median_ms'] - base:>+9.3f}")
    print(f"({args.rounds} alternating rounds of {args.reps} replays per variant and step)")
    print(f"wrote {write_results('ab_step', {'summary': summary, 'rows': rows})}")


if __name__ == "__main__":
    main()
