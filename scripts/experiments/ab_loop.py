"""One request alone through the engine core against the per-sequence loop it replaced (`old_loop.py`), in one
process on one engine: bench_spec's rounds (a plain T=1 round, DFlash K=7 rounds) with each loop in turn, twice,
so the difference can be read against the run-to-run noise. The core reads each step's picks at the step's end;
the old loop launched a plain decode step before reading the token it fed.

Usage: python scripts/experiments/ab_loop.py [--runs 3] [--new 48]  (a GPU; the 27B shape, 8k-speed formats)
"""
from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent.parent), str(HERE.parent), str(HERE)]

import bench_spec  # noqa: E402
import old_loop  # noqa: E402
import torch  # noqa: E402

from engine import Engine, EngineConfig  # noqa: E402
from engine.runtime.drafting.drafters import make_drafter  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--new", type=int, default=48)
    args = ap.parse_args()
    config = EngineConfig("synthetic:qwen3.6-27b", device="cuda", weights=bench_spec.FORMATS, kv_dtype="int8",
                          max_context=bench_spec.CONTEXT + 64, held_sequences=0, cuda_graphs=False)
    eng = Engine(config)
    prompt = torch.randint(0, 200000, (bench_spec.CONTEXT,), generator=torch.Generator().manual_seed(0)).tolist()
    cache = eng.model.new_cache(eng.max_context)
    drafter = make_drafter(replace(config, spec="dflash", drafter="synthetic:dflash-qwen3.6-27b", cuda_graphs=True),
                           eng.model)
    loops = {"core": bench_spec.generate, "old loop": old_loop.generate}
    results: dict[tuple[str, str], list[float]] = {}
    for _ in range(2):
        for name, gen in loops.items():
            bench_spec.generate = gen
            for label, d, k in (("T=1", None, 0), ("dflash K=7", drafter, 7)):
                r = bench_spec.rounds(eng, cache, d, k, prompt, args.new, args.runs, True, 0.0)
                results.setdefault((name, label), []).append(r.ms)
                print(f"{name:9s} {label:11s} {r.ms:7.2f} ms/round  runs " + " ".join(f"{x:.2f}" for x in r.per_run),
                      flush=True)
    for label in ("T=1", "dflash K=7"):
        core, old = min(results["core", label]), min(results["old loop", label])
        print(f"{label:11s} core {core:.2f} ms, old loop {old:.2f} ms: core / old = {core / old:.3f}")


if __name__ == "__main__":
    main()
