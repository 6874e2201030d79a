"""CPU benchmark of the default model: prefill and decode tok/s, as a table and JSON under scripts/results/.

Usage: python scripts/bench_cpu.py [--model M] [--prompt-tokens 256] [--new 64] [--runs 3]
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path

import torch

from engine import Engine, EngineConfig, SamplingParams
from ninfer_tui.models import resolve


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--prompt-tokens", type=int, default=256)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "bench_cpu.json"))
    args = ap.parse_args()

    engine = Engine(EngineConfig(model=resolve(args.model, announce=False), device="cpu"))
    g = torch.Generator().manual_seed(0)
    rows = []
    for run in range(args.runs + 1):  # run 0 is the warm-up
        prompt = torch.randint(100, engine.spec.vocab_size, (args.prompt_tokens,), generator=g).tolist()
        t = time.perf_counter()
        final = engine.complete(prompt, SamplingParams(max_tokens=args.new, temperature=0, ignore_eos=True))
        wall = time.perf_counter() - t
        if run:
            rows.append({"run": run, "prefill_tok_s": final.timings.prefill_tok_s,
                         "decode_tok_s": final.timings.decode_tok_s, "wall_s": wall})
    summary = {
        "model": args.model, "device": "cpu", "cpu": platform.processor() or platform.machine(),
        "threads": torch.get_num_threads(), "cores": os.cpu_count(), "torch": torch.__version__,
        "prompt_tokens": args.prompt_tokens, "new_tokens": args.new, "runs": rows,
        "prefill_tok_s_median": statistics.median(r["prefill_tok_s"] for r in rows),
        "decode_tok_s_median": statistics.median(r["decode_tok_s"] for r in rows),
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(summary, indent=2))
    print(f"{'run':>4} {'prefill tok/s':>14} {'decode tok/s':>13} {'wall s':>8}")
    for r in rows:
        print(f"{r['run']:>4} {r['prefill_tok_s']:>14.1f} {r['decode_tok_s']:>13.1f} {r['wall_s']:>8.2f}")
    print(f"median: prefill {summary['prefill_tok_s_median']:.1f} tok/s, decode {summary['decode_tok_s_median']:.1f}"
          f" tok/s ({summary['threads']} threads) -> {args.out}")


if __name__ == "__main__":
    main()
