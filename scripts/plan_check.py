"""The memory plan against what the engine really allocates, on a GPU: load a model with a profile-like config,
run one long request, compare torch's allocator peaks with `engine.memory_plan`.

Usage: python scripts/plan_check.py [--model synthetic:qwen3.6-27b] [--context 8192]
   -> table + scripts/results/plan_check_<gpu>.json (or $OUT/)
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench_util import write_results  # noqa: E402

from engine import Engine, EngineConfig, SamplingParams  # noqa: E402
from engine.memory_plan import GIB  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="synthetic:qwen3.6-27b")
    ap.add_argument("--context", type=int, default=8192)
    ap.add_argument("--kv-dtype", default="bf16")
    args = ap.parse_args()
    gpu = torch.cuda.get_device_name()
    rows = []
    config = EngineConfig(model=args.model, device="cuda", dtype="bfloat16", kv_dtype=args.kv_dtype,
                          max_context=args.context, prefill_chunk=512, cuda_graphs=False, held_sequences=1)
    torch.cuda.reset_peak_memory_stats()
    engine = Engine(config)
    plan = engine.plan
    after_load = torch.cuda.memory_allocated()
    prompt = list(range(1000, 1000 + args.context - 16))
    final = engine.complete(prompt, SamplingParams(max_tokens=16, temperature=0))
    peak = torch.cuda.max_memory_allocated()
    held = torch.cuda.memory_allocated()
    for name, planned, measured in (
        ("weights (after load)", plan.weights, after_load),
        ("held sequence: KV + state + snapshot (after the request)", None, held - after_load),
        ("peak allocated during the request", plan.device_total - plan.runtime, peak),
    ):
        rows.append({"gpu": gpu, "model": args.model, "context": args.context, "kv_dtype": args.kv_dtype,
                     "what": name, "planned_bytes": planned, "measured_bytes": measured,
                     "ratio": None if planned is None else measured / planned})
    for r in rows:
        p = "-" if r["planned_bytes"] is None else f"{r['planned_bytes'] / GIB:8.3f}"
        print(f"{r['what']:58s} planned {p} GiB  measured {r['measured_bytes'] / GIB:8.3f} GiB")
    print("plan:", json.dumps({k: round(v / GIB, 3) for k, v in plan.as_dict().items() if isinstance(v, int)}))
    print(f"prefill {final.timings.prefill_tok_s:.0f} tok/s, decode {final.timings.decode_tok_s:.1f} tok/s")
    write_results("plan_check", {"rows": rows, "plan": plan.as_dict(), "prefill_tok_s": final.timings.prefill_tok_s,
                                 "decode_tok_s": final.timings.decode_tok_s}, tag=gpu)


if __name__ == "__main__":
    main()
