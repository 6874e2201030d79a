"""Long context through the engine, as a request runs it (chunked at --chunk, the profile's KV format).

`prefill`: at each of --contexts, the prefill rate of a random prompt of that length, from the request's own
timing (admission to its first token), after a warm-up prompt (kernels compile and tune on first use).
`decode`: at each of those contexts, the median time per token of a greedy reply once the prompt is held, from
its token events' times, against its bytes floor: the bytes a one-token step reads (bench_decode's
`step_floor_bytes`: the weights without the embedding table, the context's KV, the recurrent state read and
written) over the device copy rate measured in the same run (CUDA only: the floor is null on the CPU). When both
run, one request per context serves them: its prefill, then its reply.
`resume-held` and `resume-disk`: resuming a long conversation, the time to first token of its next turn when the
conversation is still held and after a restart, loaded from the disk tier, each beside the first turn's time to
first token in the same run (the re-prefill a resume saves). The first turn is a random prompt of --context
tokens; each next turn adds the reply and 32 new tokens.

Usage: python scripts/bench_long.py [--model synthetic:tiny] [--device cpu] [--context 4096] [--kv auto]
                                    [--scenarios resume-held,resume-disk] [--contexts 8192,65536]
  e.g. --model synthetic:qwen3.6-27b --device cuda --weights q5/q4 --kv fp8 --context 200000 --chunk 2048
  (the 256k-long profile's settings, without the drafter), or the same with
  --scenarios prefill,decode --contexts 8192,65536,258048
  -> table + scripts/results/bench_long_<gpu>.json (or $OUT/; `cpu` on the CPU), replacing that file's rows of
  the scenarios run and keeping the others (bench_start.py's)
"""
from __future__ import annotations

import argparse
import gc
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from itertools import pairwise
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench_decode import step_floor_bytes  # noqa: E402
from bench_util import copy_bandwidth, write_results  # noqa: E402

from engine import Engine, EngineConfig, FinishEvent, SamplingParams, TokenEvent  # noqa: E402
from engine.config import WeightFormats  # noqa: E402

WEIGHTS = {"auto": WeightFormats(), "q5/q4": WeightFormats(attn="q5", gdn="q5", mlp="q4", embed="q8", lm_head="q8")}
RESUME = ("resume-held", "resume-disk")
SCENARIOS = ("prefill", "decode", *RESUME)
REPLY, NEW_TURN = 16, 32
DECODE = 32  # decode steps timed at each context (the reply's first token ends the prefill)


@dataclass
class Reply:
    ttft_s: float  # from submitting to the first token
    gaps_s: list[float]  # between consecutive tokens: one decode step each
    final: FinishEvent


def reply(eng: Engine, prompt: list[int], max_tokens: int) -> Reply:
    """A greedy reply of `max_tokens` tokens to `prompt`, each token's arrival timed."""
    if eng.device.type == "cuda":
        torch.cuda.synchronize()  # nothing earlier still runs on the device when the clock starts
    t0 = time.perf_counter()
    times, final = [], None
    for event in eng.submit(prompt, SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)):
        if isinstance(event, TokenEvent) and event.token_id is not None:
            times.append(time.perf_counter())  # the host has the token: its step has ended on the device
        final = event
    return Reply(times[0] - t0, [b - a for a, b in pairwise(times)], final)


def turn(eng: Engine, prompt: list[int]) -> tuple[float, list[int], int]:
    """Time to the first token (from submitting), the reply, and the tokens the engine found cached."""
    r = reply(eng, prompt, REPLY)
    return r.ttft_s, r.final.token_ids, r.final.cached_tokens


def random_prompt(tokens: int, vocab: int, seed: int) -> list[int]:
    return torch.randint(0, vocab, (tokens,), generator=torch.Generator().manual_seed(seed)).tolist()


def context_rows(args: argparse.Namespace, scenarios: list[str], contexts: list[int], vocab: int,
                 gpu: str | None) -> list[dict]:
    """The `prefill` and `decode` rows at each context: one engine that holds the longest context with its
    reply, nothing held between requests (each prompt prefills whole)."""
    bw = None
    if args.device == "cuda":  # measured before the engine takes its memory, the buffers given back after
        bw = copy_bandwidth()
        torch.cuda.empty_cache()
        print(f"{gpu}: device copy {bw / 1e9:.0f} GB/s")
    eng = Engine(EngineConfig(args.model, device=args.device, weights=WEIGHTS[args.weights], kv_dtype=args.kv,
                              max_context=max(contexts) + DECODE + 1, prefill_chunk=args.chunk, held_sequences=0))
    # warm-up: a full chunk from position 0, another over its KV, a last short one, then decode steps
    reply(eng, random_prompt(min(min(contexts), 2 * args.chunk + 201), vocab, seed=2), 4)
    decode = "decode" in scenarios
    rows = []
    print(f"{'context':>8}  {'prefill tok/s':>13}  {'prefill s':>9}  {'decode ms':>9}  {'floor ms':>8}  ratio")
    for i, context in enumerate(contexts):
        r = reply(eng, random_prompt(context, vocab, seed=3 + i), DECODE + 1 if decode else 1)
        timings = r.final.timings
        common = {"gpu": gpu, "model": args.model, "context": context, "kv_dtype": args.kv, "weights": args.weights,
                  "chunk": args.chunk}
        if "prefill" in scenarios:
            rows.append({**common, "scenario": "prefill", "prefill_s": round(timings.prefill_s, 4),
                         "prefill_tok_s": round(timings.prefill_tok_s, 1), "decode_ms": None,
                         "decode_floor_ms": None})
        ms = floor = None
        if decode:
            ms = 1e3 * statistics.median(r.gaps_s)
            floor = step_floor_bytes(eng, context, args.kv) / bw * 1e3 if bw is not None else None
            rows.append({**common, "scenario": "decode", "prefill_tok_s": None, "decode_ms": round(ms, 3),
                         "decode_tokens": len(r.gaps_s),
                         "decode_floor_ms": round(floor, 3) if floor is not None else None,
                         "ratio_to_floor": round(ms / floor, 3) if floor is not None else None,
                         "copy_bw_gbs": round(bw / 1e9, 1) if bw is not None else None})
        print(f"{context:8}  {timings.prefill_tok_s:13.1f}  {timings.prefill_s:9.3f}  "
              + (f"{ms:9.3f}  " if ms is not None else f"{'-':>9}  ")
              + (f"{floor:8.3f}  {ms / floor:5.2f}" if floor is not None else f"{'-':>8}  {'-':>5}"))
    if decode and bw is None:
        print("decode floor: none on the CPU (the floor's copy rate is the GPU's)")
    eng.close()
    return rows


def resume_rows(args: argparse.Namespace, scenarios: list[str], vocab: int, gpu: str | None) -> list[dict]:
    """The `resume-held` and `resume-disk` rows: a conversation of --context tokens and its next turns."""
    prompt = random_prompt(args.context, vocab, seed=0)
    new_turn = random_prompt(NEW_TURN, vocab, seed=1)
    with tempfile.TemporaryDirectory() as folder:
        config = EngineConfig(args.model, device=args.device, weights=WEIGHTS[args.weights], kv_dtype=args.kv,
                              max_context=args.context + 3 * (REPLY + NEW_TURN) + 64, prefill_chunk=args.chunk,
                              held_dir=folder, held_disk_mib=1 << 20)
        eng = Engine(config)
        turn(eng, prompt[:256])  # warm-up: the kernels of a prefill and of decoding
        eng.drop_held()
        cold, reply_ids, _ = turn(eng, prompt)
        conversation = prompt + reply_ids + new_turn
        rows = []

        def row(scenario: str, ttft: float, cached: int) -> None:
            rows.append({"gpu": gpu, "model": args.model, "context": len(conversation), "kv_dtype": args.kv,
                         "weights": args.weights, "scenario": scenario, "ttft_s": round(ttft, 4),
                         "cached_tokens": cached, "reprefill_ttft_s": round(cold, 4),
                         "prefill_tok_s": round(len(prompt) / cold, 1)})
            print(f"{scenario:12} context {len(conversation):7}  ttft {ttft:8.3f} s  (re-prefill of "
                  f"{len(prompt)} tokens: {cold:.3f} s), {cached} tokens cached")

        if "resume-held" in scenarios:
            ttft, reply_ids, cached = turn(eng, conversation)
            row("resume-held", ttft, cached)
            conversation = conversation + reply_ids + new_turn
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
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="synthetic:tiny")
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    ap.add_argument("--context", type=int, default=4096, help="tokens of the resumed conversation's first turn")
    ap.add_argument("--contexts", default=None,
                    help="prompt lengths of prefill and decode, comma-separated (default: --context)")
    ap.add_argument("--kv", default="auto", help="kv_dtype")
    ap.add_argument("--weights", default="auto", choices=sorted(WEIGHTS))
    ap.add_argument("--chunk", type=int, default=2048, help="prefill_chunk")
    ap.add_argument("--scenarios", default=",".join(RESUME), help=f"any of {', '.join(SCENARIOS)}")
    args = ap.parse_args()
    scenarios = args.scenarios.split(",")
    unknown = set(scenarios) - set(SCENARIOS)
    if unknown:
        ap.error(f"unknown scenarios {sorted(unknown)}; known: {', '.join(SCENARIOS)}")
    try:
        contexts = [int(c) for c in args.contexts.split(",")] if args.contexts else [args.context]
    except ValueError:
        ap.error(f"--contexts must be comma-separated token counts (e.g. 8192,65536), got {args.contexts!r}")
    if min(contexts) < 1:
        ap.error(f"--contexts must be positive token counts, got {args.contexts!r}")
    gpu = torch.cuda.get_device_name() if args.device == "cuda" else None
    vocab = 256 if args.model == "synthetic:tiny" else 200000
    rows = []
    if {"prefill", "decode"} & set(scenarios):
        rows += context_rows(args, scenarios, contexts, vocab, gpu)
        gc.collect()
        if args.device == "cuda":
            torch.cuda.empty_cache()  # the next engine's memory check sees the first one's given back
    if set(RESUME) & set(scenarios):
        rows += resume_rows(args, scenarios, vocab, gpu)
    print("wrote", write_results("bench_long", rows, tag="cpu" if args.device == "cpu" else None,
                                merge_key="scenario"))


if __name__ == "__main__":
    main()
