"""Experiment: the concurrency benchmark with each request's drafts made alone (a drafter call per request, as
before the drafter's batch), for an A/B against the batched drafts in the same device call.

Usage: python scripts/experiments/drafts_alone.py [bench_concurrency.py's arguments]
  (writes bench_concurrency_<gpu>.json like it: give it another $OUT)
"""
import runpy
import sys
from pathlib import Path

from engine.runtime import core

ROOT = Path(__file__).resolve().parents[2]


def alone(target, drafter, seqs, counts):
    return [drafter.propose_rows([s.cache], [s.out.history], [k])[0] for s, k in zip(seqs, counts, strict=True)]


core.draft_rows = alone
sys.path.insert(0, str(ROOT / "scripts"))  # bench_util, as when the benchmark runs itself
sys.argv = [str(ROOT / "scripts" / "bench_concurrency.py"), *sys.argv[1:]]
runpy.run_path(sys.argv[0], run_name="__main__")
