"""Host time of the n-gram drafter per speculative round: the scan (`lookup`, the reference) against the
incremental index (`NgramIndex`) over contexts of 2K-128K tokens, each round adding a few accepted tokens as a
verify step does. Two kinds of history: random ids over the Qwen vocabulary (few matches: the scan's worst case,
it reads the whole context at every n) and random ids over 64 (short n-grams match often, longer ones rarely).
The GPU round this competes with is 6-11 ms on an H200 (scripts/results/bench_spec_*). Also the index's one-time
build on the first round (the whole prompt).

Usage: python scripts/bench_ngram.py -> table + scripts/results/bench_ngram_cpu.json (or $OUT/)
"""
from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench_util import write_results  # noqa: E402

from engine.runtime.drafting.ngram import NgramIndex, lookup  # noqa: E402

CONTEXTS = (2048, 8192, 32768, 131072)
ROUNDS, K, VOCAB = 20, 7, 248077


def per_round_ms(history: list[int], vocab: int, draft) -> float:
    """Median time of `draft(history)` over rounds that each append 1-8 tokens (what a round accepts)."""
    rng = random.Random(1)
    times = []
    for _ in range(ROUNDS):
        history.extend(rng.randrange(vocab) for _ in range(rng.randrange(1, 9)))
        t = time.perf_counter()
        draft(history)
        times.append(time.perf_counter() - t)
    return sorted(times)[len(times) // 2] * 1e3


def main() -> None:
    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
    rows = []
    print(f"{'history':12s} {'context':>8s} {'scan ms':>9s} {'index ms':>9s} {'build ms':>9s} {'speedup':>8s}")
    for kind, vocab in (("random ids", VOCAB), ("64 ids", 64)):
        for n in CONTEXTS:
            rng = random.Random(n)
            base = [rng.randrange(vocab) for _ in range(n)]
            scan = per_round_ms(list(base), vocab, lambda h: lookup(h, K))
            index = NgramIndex()
            history = list(base)
            t = time.perf_counter()
            index.lookup(history, K)
            build = (time.perf_counter() - t) * 1e3
            fast = per_round_ms(history, vocab, lambda h, ix=index: ix.lookup(h, K))
            rows.append({"gpu": "cpu", "history": kind, "context": n, "k": K, "scan_ms_per_round": scan,
                         "index_ms_per_round": fast, "index_build_ms": build, "speedup": scan / fast})
            print(f"{kind:12s} {n:8d} {scan:9.3f} {fast:9.4f} {build:9.1f} {scan / fast:7.0f}x")
    print("wrote", write_results("bench_ngram", rows))


if __name__ == "__main__":
    main()
