"""Speculative decoding rounds on `synthetic:qwen3.6-27b` (8k-speed formats: q5 attention/GDN, q4 MLP, q8
embeddings/head, int8 KV) at an 8K context: wall time of a round (draft + verify + accept + roll back) for
K = 3 and 7 (--ks: up to 15) against a plain T=1 round, measured through the generation loop itself.

Random weights accept no real drafts, so tok/s at acceptance 60% and 80% is projected (labelled so):
tokens per round = (1 - a^(K+1)) / (1 - a) (each draft accepted with probability a, independently), divided
by the round time. With `--draft-vocab N` a draft can be right only where the target's token lies below N, so
those rows project at a x the share of Python-source tokens below N (`draft_vocab_coverage.py`'s results).
Every round ends in one host sync (reading the accepted count), so wall time per round is
the device time per round plus that sync. On a real model path (--model PATH, default drafter ngram; on the CPU
too: --device cpu), acceptance and tokens per round are measured, greedy, on the fixed short-code task of
`ninfer speedcheck` (its chat prompt, then the prefix trick below).

Usage: python scripts/bench_spec.py [--model PATH] -> table + scripts/results/bench_spec_<gpu>.json (or $OUT/)
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench_util import gpu_name, write_results  # noqa: E402

from engine import Engine, EngineConfig, SamplingParams  # noqa: E402
from engine.config import WEIGHT_LAYOUTS, WeightFormats  # noqa: E402
from engine.runtime.drafting.drafters import make_drafter  # noqa: E402
from engine.runtime.generate import generate  # noqa: E402
from engine.runtime.lanes import Lanes  # noqa: E402
from engine.runtime.request import FinishEvent  # noqa: E402
from engine.runtime.runner import GraphRunner  # noqa: E402

FORMATS = WeightFormats(attn="q5", gdn="q5", mlp="q4", embed="q8", lm_head="q8")
CONTEXT = 8192  # the 8K short-code setting


def projected(a: float, k: int) -> float:
    return (1 - a ** (k + 1)) / (1 - a)


def coverage(vocab: int) -> float:
    """The least share of tokens below `vocab` over the Python corpora of draft_vocab_coverage.py (1 for 0)."""
    if not vocab:
        return 1.0
    path = ROOT / "scripts" / "results" / "draft_vocab_coverage_qwen3_6_tokenizer.json"
    shares = [r["share_below"] for r in json.loads(path.read_text())
              if r["draft_vocab"] == vocab and r["corpus"].startswith("python")]
    if not shares:
        sys.exit(f"no coverage measured for draft_vocab {vocab}: run scripts/draft_vocab_coverage.py --sizes {vocab}")
    return min(shares)


@dataclass
class Rounds:
    per_run: list[float]  # each run's ms per round
    acceptance: float | None
    tokens: float  # per round: its accepted drafts and the target's token
    capture_s: float  # the graphs' capture

    @property
    def ms(self) -> float:
        return statistics.median(self.per_run)


def rounds(eng: Engine, cache, drafter, k: int, prompt: list[int], new: int, runs: int,
           graphs: bool, temperature: float) -> Rounds:
    """`runs` generations of `new` tokens after one shared prefill, in `cache`, through CUDA graphs of T = 1 and
    K+1 (and the drafter's own) captured for this drafter as the engine captures them at load (or eagerly)."""
    model, capture_s = eng.model, 0.0
    if graphs:
        model = GraphRunner(eng.model, Lanes([cache]), (1, k + 1) if k else (1,), drafter)
        t0 = time.perf_counter()
        model.capture_all()
        capture_s = time.perf_counter() - t0
    cache.reset()
    params = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    list(generate(model, eng.tokenizer, prompt[:-1], params, cache, 1024, drafter=drafter, draft_tokens=k))
    cache.length = len(prompt) - 1  # the prefix stays; each run feeds the last prompt token and goes on
    saved = cache.states.snapshot() if cache.states is not None else None  # llama: KV only
    # sampled rounds filter as the 8k-speed profile does (top-k 20, top-p 0.95)
    params = SamplingParams(max_tokens=new, temperature=temperature, top_k=20 if temperature else 0,
                            top_p=0.95 if temperature else 1.0, ignore_eos=True, seed=0)
    per_round, accepted, drafted, n_rounds = [], 0, 0, 0
    for _ in range(runs):
        cache.length = len(prompt) - 1
        if saved is not None:
            cache.states.restore(saved)
        final = [e for e in generate(model, eng.tokenizer, prompt, params, cache, 1024, drafter=drafter,
                                     draft_tokens=k) if isinstance(e, FinishEvent)][0]
        n = final.spec.rounds if final.spec else final.timings.decode_steps
        per_round.append(1e3 * final.timings.decode_s / n)
        n_rounds += n
        if final.spec:
            accepted, drafted = accepted + final.spec.accepted, drafted + final.spec.drafted
    return Rounds(per_round, accepted / drafted if drafted else None, (accepted + n_rounds) / n_rounds, capture_s)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="synthetic:qwen3.6-27b")
    p.add_argument("--dflash", default="synthetic:dflash-qwen3.6-27b")
    p.add_argument("--new", type=int, default=24)
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--device", default="cuda")
    p.add_argument("--context", type=int, default=CONTEXT)
    p.add_argument("--eager", action="store_true", help="no CUDA graphs")
    p.add_argument("--drafters", default=None,
                   help="which drafters to time (comma-separated; default mtp,dflash on synthetic models, ngram on a "
                   "model path)")
    p.add_argument("--temperature", type=float, default=0.0,
                   help="> 0: sampled rounds (rejection sampling, the 8k-speed profile's top-k/top-p)")
    p.add_argument("--layout", choices=WEIGHT_LAYOUTS, default="auto",
                   help="the q4/q5 weight layout (auto: tiles, as the engine loads them with a drafter)")
    p.add_argument("--draft-vocab", type=int, nargs="+", default=[0],
                   help="drafters guess among the first N token ids (the engine's draft_vocab; 0: all): one set of "
                   "rows per value")
    p.add_argument("--ks", type=int, nargs="+", default=[3, 7], help="drafts per round to time (up to 15)")
    p.add_argument("--t1-rows", action="store_true",
                   help="also time the plain T=1 round of an engine loaded without a drafter (row-major q4/q5, as "
                   "weight_layout auto loads it for plain decode), in the same run: the faster plain step")
    args = p.parse_args()
    synthetic = args.model.startswith("synthetic:")
    names = (args.drafters or ("mtp,dflash" if synthetic else "ngram")).split(",")
    cuda = args.device == "cuda"
    config = EngineConfig(args.model, device=args.device, weights=FORMATS if cuda else WeightFormats(),
                          weight_layout=args.layout, kv_dtype="int8" if cuda else "auto", max_context=args.context + 64,
                          spec="mtp" if "mtp" in names else "none", held_sequences=0,
                          cuda_graphs=False)  # graphs per drafter below
    eng = Engine(config)  # spec = mtp keeps the MTP head; other drafters are built beside it
    graphs = cuda and not args.eager
    if synthetic:  # random weights: any tokens; the round's cost is what is measured
        g = torch.Generator().manual_seed(0)
        prompt = torch.randint(0, min(200000, eng.geometry.vocab_size), (args.context,), generator=g).tolist()
    else:  # a real model drafts (or not) on the fixed short-code task of `ninfer speedcheck`
        from ninfer_tui.speedcheck import TASK

        prompt = eng.encode_chat([{"role": "user", "content": TASK}])
    path = "cuda graphs" if graphs else "eager"
    model_name = args.model if synthetic else Path(args.model).name
    cache = eng.model.new_cache(eng.max_context)  # one cache for every drafter's graphs in turn
    t1_ms = rounds(eng, cache, None, 0, prompt, args.new, args.runs, graphs, args.temperature).ms
    rows = []
    print(f"{gpu_name()}: plain T=1 round {t1_ms:.1f} ms ({1e3 / t1_ms:.1f} tok/s)")
    for name, vocab in ((n, v) for n in names for v in args.draft_vocab):
        drafter = make_drafter(replace(config, spec=name, drafter=args.dflash, cuda_graphs=graphs, draft_vocab=vocab),
                               eng.model)
        label = f"{name}/{vocab}" if vocab else name
        cover = coverage(vocab)
        for k in args.ks:
            timed = rounds(eng, cache, drafter, k, prompt, args.new, args.runs, graphs, args.temperature)
            ms, acc, measured, capture_s = timed.ms, timed.acceptance, timed.tokens, timed.capture_s
            for a in ((0.6, 0.8) if synthetic else (acc,)):
                tokens = projected(a * cover, k) if synthetic else measured
                rows.append({"gpu": gpu_name(), "model": model_name, "spec": name, "draft_vocab": vocab, "K": k,
                             "round_ms": ms, "t1_ms": t1_ms, "round_over_t1": ms / t1_ms,
                             "acceptance_rate": None if synthetic else acc,
                             "assumed_acceptance": a if synthetic else None, "vocab_coverage": cover,
                             "projected": synthetic, "tokens_per_round": tokens, "tok_s": tokens * 1e3 / ms,
                             "temperature": args.temperature, "path": f"{path}, host-timed rounds",
                             "layout": args.layout, "capture_s": capture_s,
                             # what the timed rounds emitted (random weights keep some drafts when sampling), for
                             # reading round_ms: a round's host work grows with the tokens it emits
                             "tokens_per_round_timed": measured, "round_ms_runs": timed.per_run})
                shown = "n/a (no drafts)" if a is None else f"{a:.2f}"
                print(f"{label:12s} K={k}  round {ms:7.1f} ms = {ms / t1_ms:4.2f} x T=1   at acceptance {shown}: "
                      f"{tokens:.2f} tokens/round -> {tokens * 1e3 / ms:6.1f} tok/s"
                      f"{' (projected)' if synthetic else ''}; timed rounds emitted {measured:.2f} tokens each; "
                      f"graphs captured in {capture_s:.1f} s; runs " + " ".join(f"{x:.2f}" for x in timed.per_run))
        del drafter  # one drafter's weights at a time
    rows.append({"gpu": gpu_name(), "model": model_name, "spec": "none", "draft_vocab": 0, "K": 0, "round_ms": t1_ms,
                 "t1_ms": t1_ms, "acceptance_rate": None, "projected": False, "tok_s": 1e3 / t1_ms,
                 "temperature": args.temperature, "path": f"{path}, host-timed rounds", "layout": args.layout})
    if args.t1_rows:  # after the drafters' engine is gone: both need not fit at once
        del eng, cache
        torch.cuda.empty_cache()
        plain = Engine(replace(config, spec="none", weight_layout="rows"))
        ms = rounds(plain, plain.model.new_cache(plain.max_context), None, 0, prompt, args.new, args.runs, graphs,
                    args.temperature).ms
        for r in rows:
            r["t1_rows_ms"], r["round_over_t1_rows"] = ms, r["round_ms"] / ms
        rows.append({"gpu": gpu_name(), "model": model_name, "spec": "none", "draft_vocab": 0, "K": 0, "round_ms": ms,
                     "t1_ms": ms, "acceptance_rate": None, "projected": False, "tok_s": 1e3 / ms,
                     "temperature": args.temperature, "path": f"{path}, host-timed rounds", "layout": "rows"})
        k7 = {f"{r['spec']}/{r['draft_vocab']}" if r["draft_vocab"] else r["spec"]: r["round_ms"] / ms
              for r in rows if r["K"] == 7}
        print(f"plain T=1 round, row-major weights: {ms:.1f} ms; K=7 rounds over it: "
              + ", ".join(f"{name} {x:.2f}x" for name, x in k7.items()))
    print("wrote", write_results("bench_spec" if args.temperature == 0 else "bench_spec_sampled", rows))


if __name__ == "__main__":
    main()
