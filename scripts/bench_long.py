"""Resuming a long conversation: time to first token of its next turn when the conversation is still held
(`resume-held`) and after a restart, loaded from the disk tier (`resume-disk`), each beside the first turn's time
to first token in the same run (the re-prefill a resume saves). The first turn is a random prompt of --context
tokens; each next turn adds the reply and 32 new tokens.

Usage: python scripts/bench_long.py [--model synthetic:tiny] [--device cpu] [--context 4096] [--kv auto]
  e.g. --model synthetic:qwen3.6-27b --device cuda --weights q5/q4 --kv fp8 --context 200000 --chunk 2048
  (the 256k-long profile's settings, without the drafter)
  -> table + scripts/results/bench_long_<gpu>.json (or $OUT/; `cpu` on the CPU)
"""
from __future__ import annotations

import argparse
import gc
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench_util import write_results  # noqa: E402

from engine import Engine, EngineConfig, SamplingParams, TokenEvent  # noqa: E402
from engine.config import WeightFormats  # noqa: E402

WEIGHTS = {"auto": WeightFormats(), "q5/q4": WeightFormats(attn="q5", gdn="q5", mlp="q4", embed="q8", lm_head="q8")}
SCENARIOS = ("resume-held", "resume-disk")
REPLY, NEW_TURN = 16, 32


def turn(eng: Engine, prompt: list[int]) -> tuple[float, list[int], int]:
    """Time to the first token (from submitting), the reply, and the tokens the engine found cached."""
    t0 = time.perf_counter()
    ttft, final = None, None
    for event in eng.submit(prompt, SamplingParams(max_tokens=REPLY, temperature=0, ignore_eos=True)):
        if ttft is None and isinstance(event, TokenEvent):
            ttft = time.perf_counter() - t0
        final = event
    return ttft, final.token_ids, final.cached_tokens


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="synthetic:tiny")
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    ap.add_argument("--context", type=int, default=4096, help="tokens of the first turn")
    ap.add_argument("--kv", default="auto", help="kv_dtype")
    ap.add_argument("--weights", default="auto", choices=sorted(WEIGHTS))
    ap.add_argument("--chunk", type=int, default=2048, help="prefill_chunk")
    ap.add_argument("--scenarios", default=",".join(SCENARIOS))
    args = ap.parse_args()
    scenarios = args.scenarios.split(",")
    unknown = set(scenarios) - set(SCENARIOS)
    if unknown:
        ap.error(f"unknown scenarios {sorted(unknown)}; known: {', '.join(SCENARIOS)}")
    gpu = torch.cuda.get_device_name() if args.device == "cuda" else None
    vocab = 256 if args.model == "synthetic:tiny" else 200000
    prompt = torch.randint(0, vocab, (args.context,), generator=torch.Generator().manual_seed(0)).tolist()
    new_turn = torch.randint(0, vocab, (NEW_TURN,), generator=torch.Generator().manual_seed(1)).tolist()
    with tempfile.TemporaryDirectory() as folder:
        config = EngineConfig(args.model, device=args.device, weights=WEIGHTS[args.weights], kv_dtype=args.kv,
                              max_context=args.context + 3 * (REPLY + NEW_TURN) + 64, prefill_chunk=args.chunk,
                              held_dir=folder, held_disk_mib=1 << 20)
        eng = Engine(config)
        turn(eng, prompt[:256])  # warm-up: the kernels of a prefill and of decoding
        eng.drop_held()
        cold, reply, _ = turn(eng, prompt)
        conversation = prompt + reply + new_turn
        rows = []

        def row(scenario: str, ttft: float, cached: int) -> None:
            rows.append({"gpu": gpu, "model": args.model, "context": len(conversation), "kv_dtype": args.kv,
                         "weights": args.weights, "scenario": scenario, "ttft_s": round(ttft, 4),
                         "cached_tokens": cached, "reprefill_ttft_s": round(cold, 4),
                         "prefill_tok_s": round(len(prompt) / cold, 1)})
            print(f"{scenario:12} context {len(conversation):7}  ttft {ttft:8.3f} s  (re-prefill of "
                  f"{len(prompt)} tokens: {cold:.3f} s), {cached} tokens cached")

        if "resume-held" in scenarios:
            ttft, reply, cached = turn(eng, conversation)
            row("resume-held", ttft, cached)
            conversation = conversation + reply + new_turn
        if "resume-disk" in scenarios:
            eng.close()  # writes what it holds, as at the end of a process
            del eng
            gc.collect()
            if args.device == "cuda":
                torch.cuda.empty_cache()
            eng = Engine(config)
            ttft, _, cached = turn(eng, conversation)
            files = sum(f.stat().st_size for f in Path(folder).glob("*.safetensors"))
            row("resume-disk", ttft, cached)
            rows[-1]["disk_mib"] = round(files / (1 << 20), 1)
        eng.close()  # before its folder goes
    print("wrote", write_results("bench_long", rows, tag="cpu" if args.device == "cpu" else None,
                                merge_key="scenario"))


if __name__ == "__main__":
    main()
