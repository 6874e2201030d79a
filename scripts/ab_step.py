"""Interleaved A/B of T=1 decode step variants on `synthetic:qwen3.6-27b` (8k-speed formats, row-major q5/q4,
int8 KV, 8K context), against the engine's step; one process, the same weights, a CUDA graph each, timed in
alternating rounds (a machine drifts ~0.1 ms between back-to-back runs, NOTES.md (23)). The variants (NOTES.md
(24)), each off the engine's path until measured:
- the GDN conv step in the in_proj matmul's programs (`qwen3_5.CONV_IN_PROJ`: 48 launches fewer);
- one-row matmuls that ask L2 for the next matmul's codes (`kernels/prefetch.py`; the next one in the step's
  order, the lm head's next being layer 0's first): in a launch after the matmul (~1.5 us per launch in a
  graph) or by the matmul's own programs as they end (v7 with PF, no launch); in each way only where the next
  weight fits in half the L2 whole (the GDN and attention out projections, 2.4x their read time on the H200: the
  conv and GDN step or the attention run between them and the matmul before), or after every matmul (its first
  L2/2 bytes).

Usage: python scripts/ab_step.py [--rounds 8 --reps 30] -> table + scripts/results/ab_step_<gpu>.json
"""
from __future__ import annotations

import argparse
import statistics
import sys
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


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--reps", type=int, default=30)
    args = p.parse_args()
    formats, layout = MIXES["q5/q4 mix"]
    eng = Engine(EngineConfig("synthetic:qwen3.6-27b", device="cuda", weights=formats, weight_layout=layout,
                              max_context=16, kv_dtype="int8", held_sequences=0, cuda_graphs=False))
    cache = eng.model.new_cache(CONTEXT + 16)
    order = decode_order(eng.model, cache)
    print(f"{len(order)} matmuls per T=1 step")
    qmatmul.PREFETCH_BYTES = torch.cuda.get_device_properties(0).L2_cache_size // 2
    variants = {}
    fits = lambda nxt: nxt.codes.nbytes <= qmatmul.PREFETCH_BYTES  # noqa: E731
    every = lambda nxt: True  # noqa: E731
    none = lambda nxt: False  # noqa: E731
    # (name, conv in in_proj, which matmuls prefetch the next, prefetch in v7's tail)
    for name, conv, wanted, tail in (("engine", False, none, False), ("conv in in_proj", True, none, False),
                                     ("prefetch launch, out projs", False, fits, False),
                                     ("prefetch launch, every matmul", False, every, False),
                                     ("prefetch tail, out projs", False, fits, True),
                                     ("prefetch tail, every matmul", False, every, True)):
        # read when the step is captured; the graph keeps what ran then
        for w, nxt in zip(order, order[1:] + order[:1], strict=True):
            w.prefetch = nxt.codes if wanted(nxt) else None
        qmatmul.PREFETCH_IN_TAIL, qwen3_5.CONV_IN_PROJ = tail, conv
        print(f"{name}: {sum(w.prefetch is not None for w in order)} matmuls prefetch")
        cache = eng.model.new_cache(CONTEXT + 16)
        runner = GraphRunner(eng.model, Lanes([cache]), (1,))
        runner.capture_all()
        fill_cache(cache, CONTEXT)
        variants[name] = (runner, cache)
    for w in order:
        w.prefetch = None
    qmatmul.PREFETCH_IN_TAIL, qwen3_5.CONV_IN_PROJ = False, False
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
    base = summary[0]["median_ms"]
    for s in summary[1:]:
        print(f"{s['variant']} - engine: {s['median_ms'] - base:+.3f} ms per step "
              f"({args.rounds} alternating rounds of {args.reps} replays)")
    print(f"wrote {write_results('ab_step', {'summary': summary, 'rows': rows})}")


if __name__ == "__main__":
    main()
