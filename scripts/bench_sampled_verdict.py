"""Device time of the sampled verdict (kernels/sampled_verdict.py: the tie scan, then the verdict) at the 27B's
vocabulary, given each row's candidates: a plain pick (no drafts) and a K = 7 round, with no tie past the
candidates (real logits: the scan returns at once) and with 90 tokens tied at the top-k bound past them in one row
or in every row (the scan reads the vocabulary). Graph replays (no host launch cost); the candidates' own top-k
(`row_topk_ids`: the top-k kernels, and torch's topk in the same run) timed beside them, and the vocabulary's read
at the measured copy bandwidth as the floor of a tied row's scan and of the top-k.

`--kernels FILE` times another version of the module (e.g. `git show REV:engine/kernels/sampled_verdict.py`).

Usage: python scripts/bench_sampled_verdict.py [--kernels FILE] -> table + scripts/results/sampled_verdict_<gpu>.json
"""
from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench_util import copy_bandwidth, gpu_name, write_results  # noqa: E402

from engine.kernels import topk as topk_kernel  # noqa: E402
from engine.kernels.timing import graph_ms  # noqa: E402
from engine.models.rows import row_topk_ids  # noqa: E402
from engine.runtime.sampler import CANDIDATES  # noqa: E402

VOCAB = 248320
TOP_K, TOP_P, TEMPERATURE = 20, 0.95, 0.6


def kernels(path: str | None):
    if path is None:
        from engine.kernels import sampled_verdict
        return sampled_verdict
    spec = importlib.util.spec_from_file_location("sampled_verdict_under_test", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def case(k: int, tied_rows: int, g: torch.Generator) -> tuple:
    """Logits [k + 1, VOCAB] (random; in the first `tied_rows` rows 90 tokens tie at the top-k bound past the
    candidates), their candidates, drafts, uniforms and race."""
    logits = torch.randn(k + 1, VOCAB, generator=g, device="cuda") * 3
    for r in range(tied_rows):
        tied = torch.randperm(VOCAB, generator=g, device="cuda")[:CANDIDATES + 90]
        logits[r, tied[:TOP_K - 1]] = 20.0 + torch.rand(TOP_K - 1, generator=g, device="cuda")
        logits[r, tied[TOP_K - 1:]] = 19.0
    values, ids = row_topk_ids(logits, CANDIDATES)
    drafts = ids[:k, 0].contiguous() if k else None
    u = torch.rand(k, generator=g, device="cuda") if k else None
    race = torch.empty(CANDIDATES + 2, device="cuda").exponential_(generator=g)
    return logits, values, ids, drafts, u, race


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--kernels", default=None, help="a sampled_verdict.py to time instead of the engine's")
    p.add_argument("--reps", type=int, default=50)
    args = p.parse_args()
    module = kernels(args.kernels)
    g = torch.Generator(device="cuda").manual_seed(0)
    bandwidth = copy_bandwidth()
    rows = []
    for k, tied_rows in [(0, 0), (0, 1), (7, 0), (7, 1), (7, 8)]:
        inputs = case(k, tied_rows, g)
        verdict_ms = graph_ms(lambda a=inputs: module.sampled_verdict(*a, TEMPERATURE, TOP_K, TOP_P, 0.0), calls=8,
                              reps=args.reps)
        topk_ms = graph_ms(lambda a=inputs: row_topk_ids(a[0], CANDIDATES), calls=8, reps=args.reps)
        usable, topk_kernel.usable = topk_kernel.usable, lambda *a: False  # torch's topk, for comparison
        try:
            torch_ms = graph_ms(lambda a=inputs: row_topk_ids(a[0], CANDIDATES), calls=8, reps=args.reps)
        finally:
            topk_kernel.usable = usable
        floor_ms = 2 * tied_rows * VOCAB * 4 / bandwidth * 1e3  # two scans of each tied row
        rows.append({"gpu": gpu_name(), "kernels": args.kernels or "engine", "vocab": VOCAB, "k": k,
                     "tied_rows": tied_rows, "verdict_ms": verdict_ms, "candidates_topk_ms": topk_ms,
                     "torch_topk_ms": torch_ms, "topk_floor_ms": (k + 1) * VOCAB * 4 / bandwidth * 1e3,
                     "scan_floor_ms": floor_ms})
    print(f"{'K':>2} {'tied rows':>9} {'verdict ms':>11} {'top-k ms':>9} {'torch top-k':>12} {'top-k floor':>12} "
          f"{'scan floor ms':>14}")
    for r in rows:
        print(f"{r['k']:>2} {r['tied_rows']:>9} {r['verdict_ms']:>11.4f} {r['candidates_topk_ms']:>9.4f} "
              f"{r['torch_topk_ms']:>12.4f} {r['topk_floor_ms']:>12.4f} {r['scan_floor_ms']:>14.4f}")
    tag = None if args.kernels is None else f"{gpu_name()}_{Path(args.kernels).stem}"
    print("wrote", write_results("sampled_verdict", rows, tag))


if __name__ == "__main__":
    main()
