"""Where an eager prefill chunk makes the host wait for the device: each call site (in the engine's own files) of a
synchronizing CUDA call during one prompt's prefill, with its count, from torch's sync debug mode. A sync stops the
host from queueing the next launches while the device works, so an eager chunk's wall time becomes the host's
launch time plus the device's instead of the larger of them.

Usage: python scripts/experiments/prefill_syncs.py [--tokens 2048] [--model synthetic:qwen3.6-27b]
-> one line per call site on stdout, most frequent first
"""
from __future__ import annotations

import argparse
import sys
import traceback
import warnings
from collections import Counter
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from bench_concurrency import WEIGHTS, in_thread  # noqa: E402

from engine import Engine, EngineConfig, SamplingParams  # noqa: E402
from engine.runtime.generate import generate  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="synthetic:qwen3.6-27b")
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--device", default="cuda", help="cpu: a smoke run (no CUDA call synchronizes there)")
    args = ap.parse_args()
    config = EngineConfig(args.model, device=args.device, max_concurrency=1, held_sequences=0, weights=WEIGHTS["q5/q4"],
                          kv_dtype="int8", max_context=8192)
    eng = in_thread(Engine, config)
    ids = torch.randint(0, eng.geometry.vocab_size, (args.tokens,), generator=torch.Generator().manual_seed(0)).tolist()
    cache = eng.lanes.caches[0] if eng.lanes is not None else eng.model.new_cache(args.tokens + 16)
    if eng.lanes is not None:
        assert cache.kv.table.reserve(args.tokens + 16), "the KV pool lacks room for the prompt"
    first = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)

    def once() -> None:
        cache.reset()
        with torch.inference_mode():
            list(generate(eng.model, eng.tokenizer, ids, first, cache, eng.config.prefill_chunk))

    once()  # tiles chosen for these row counts, kernels compiled
    sites: Counter[str] = Counter()

    def note(message, category, filename, lineno, file=None, line=None) -> None:
        stack = [f for f in traceback.extract_stack()[:-1] if str(ROOT) in f.filename]
        sites[" <- ".join(f"{Path(f.filename).relative_to(ROOT)}:{f.lineno}" for f in reversed(stack[-3:]))] += 1

    if args.device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings():  # restores the filters and `showwarning` as it ends
            warnings.simplefilter("always")
            warnings.showwarning = note
            once()
    finally:
        if args.device == "cuda":
            torch.cuda.set_sync_debug_mode(0)
    print(f"{sum(sites.values())} synchronizing calls in one {args.tokens}-token prefill (eager):")
    for site, n in sites.most_common():
        print(f"  {n:5d}  {site}")


if __name__ == "__main__":
    main()
