"""Interleaved A/B of the T=1 decode step on `synthetic:qwen3.6-27b` (8k-speed formats, row-major q5/q4, int8 KV,
8K context): the GDN output gate applied by the GDN step kernel (A, the engine's path) against the same gate in
a norm launch of its own (B), one process, the same weights, a CUDA graph each, timed in alternating rounds, so a
machine's drift between two runs (NOTES.md (23): ~0.1 ms between back-to-back bench_decode runs) does not enter
the comparison.

Usage: python scripts/ab_gdn_gate.py [--rounds 8 --reps 30] -> table + scripts/results/ab_gdn_gate_<gpu>.json
"""
from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench_decode import MIXES, time_step  # noqa: E402
from bench_util import fill_cache, gpu_name, write_results  # noqa: E402

from engine import Engine, EngineConfig  # noqa: E402
from engine.models import qwen3_5  # noqa: E402
from engine.runtime.lanes import Lanes  # noqa: E402
from engine.runtime.runner import GraphRunner  # noqa: E402

CONTEXT = 8192


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--reps", type=int, default=30)
    args = p.parse_args()
    formats, layout = MIXES["q5/q4 mix"]
    eng = Engine(EngineConfig("synthetic:qwen3.6-27b", device="cuda", weights=formats, weight_layout=layout,
                              max_context=16, kv_dtype="int8", held_sequences=0, cuda_graphs=False))
    fused = qwen3_5.output_gate
    variants = {}
    for name, gate in (("gate in the GDN kernel", fused), ("gate in its own norm launch", lambda *a, **k: None)):
        qwen3_5.output_gate = gate  # read when the step is captured; the graph keeps what ran then
        cache = eng.model.new_cache(CONTEXT + 16)
        runner = GraphRunner(eng.model, Lanes([cache]), (1,))
        runner.capture_all()
        fill_cache(cache, CONTEXT)
        variants[name] = (runner, cache)
    qwen3_5.output_gate = fused
    rows = []
    for r in range(args.rounds):
        for name, (runner, cache) in variants.items():
            rows.append({"gpu": gpu_name(), "model": "synthetic:qwen3.6-27b", "weights": "q5/q4 mix",
                         "kv_dtype": "int8", "context": CONTEXT, "T": 1, "variant": name, "round": r,
                         "ms_per_step": time_step(runner, cache, 1, args.reps)})
    print(f"{'variant':<30} {'median ms':>10} {'min':>8} {'max':>8}")
    summary = []
    for name in variants:
        ms = [x["ms_per_step"] for x in rows if x["variant"] == name]
        summary.append({"variant": name, "median_ms": statistics.median(ms), "min_ms": min(ms), "max_ms": max(ms)})
        print(f"{name:<30} {summary[-1]['median_ms']:>10.3f} {min(ms):>8.3f} {max(ms):>8.3f}")
    a, b = (s["median_ms"] for s in summary)
    print(f"A - B: {a - b:+.3f} ms per step ({args.rounds} alternating rounds of {args.reps} replays)")
    print(f"wrote {write_results('ab_gdn_gate', {'summary': summary, 'rows': rows})}")


if __name__ == "__main__":
    main()
