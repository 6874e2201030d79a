"""Prefill attention of one chunk over a long prefix (the 27B's full-attention shape: 24 query heads, 4 KV heads,
head dim 256, bf16): the ways torch's SDPA can be called for a chunk whose causal mask is aligned to the bottom
right (queries at the end of the keys), timed with CUDA events (median), each checked against the first.
- "bool mask, gqa": an explicit [T, L] boolean mask and enable_gqa (what `models.layers.causal_attention` did);
- "lower-right bias, gqa": torch's `causal_lower_right` bias (no mask tensor) and enable_gqa;
- "lower-right bias, kv repeated": the same bias with the KV heads repeated to the query heads.
The floor is the attention FLOPs (4 T L' H D, L' the average keys a query sees) at the measured bf16 matmul rate.

Usage: python scripts/bench_prefill_attention.py [--chunks 1024 2048] [--contexts 8192 65536]
  -> table + scripts/results/bench_prefill_attention_<gpu>.json (or $OUT/)
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench_prefill_qmatmul import bf16_rate  # noqa: E402
from bench_util import gpu_name, time_ms, write_results  # noqa: E402

H, HKV, D = 24, 4, 256


def variants(t: int, length: int):
    mask = torch.ones(t, length, dtype=torch.bool, device="cuda").tril(diagonal=length - t)
    bias = causal_lower_right(t, length)
    return {
        "bool mask, gqa": lambda q, k, v: F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True),
        "lower-right bias, gqa": lambda q, k, v: F.scaled_dot_product_attention(q, k, v, attn_mask=bias,
                                                                                enable_gqa=True),
        "lower-right bias, kv repeated": lambda q, k, v: F.scaled_dot_product_attention(
            q, k.repeat_interleave(H // HKV, 1), v.repeat_interleave(H // HKV, 1), attn_mask=bias),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--chunks", type=int, nargs="+", default=[1024, 2048])
    ap.add_argument("--contexts", type=int, nargs="+", default=[8192, 65536])
    args = ap.parse_args()
    rate = bf16_rate()
    print(f"{gpu_name()}: bf16 matmul {rate / 1e12:.0f} TFLOP/s")
    g = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    for length in args.contexts:
        for t in args.chunks:
            q = torch.randn(1, H, t, D, device="cuda", dtype=torch.bfloat16, generator=g)
            k, v = (torch.randn(1, HKV, length, D, device="cuda", dtype=torch.bfloat16, generator=g) for _ in "kv")
            seen = length - t + (t + 1) / 2  # keys per query on average
            floor = 4 * t * seen * H * D / rate * 1e3
            want = None
            for name, fn in variants(t, length).items():
                try:
                    out = fn(q, k, v)
                    ms = time_ms(lambda fn=fn, q=q, k=k, v=v: fn(q, k, v), 10, warmup=2)
                except torch.OutOfMemoryError:
                    print(f"  {name}: out of memory")
                    continue
                want = out if want is None else want
                err = ((out.float() - want.float()).norm() / want.float().norm()).item()
                rows.append({"gpu": gpu_name(), "variant": name, "chunk": t, "context": length, "ms": ms,
                             "floor_ms": floor, "ratio_to_floor": ms / floor, "rel_error_vs_first": err})
                print(f"L={length:6d} T={t:5d} {name:30s} {ms:8.2f} ms  floor {floor:6.2f}  "
                      f"({ms / floor:5.1f}x)  err {err:.1e}")
                del out
            torch.cuda.empty_cache()
    print("wrote", write_results("bench_prefill_attention", rows))


if __name__ == "__main__":
    main()
