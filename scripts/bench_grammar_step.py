"""What a JSON-schema mask costs a decode step, and what a schema does to speculative acceptance, against
unconstrained rows of the same engine in the same run (issue #50's target: the mask's overhead <= 5% of the step).

Plain steps (--spec none): 1 and 8 requests at once (--sizes), greedy, each under a JSON schema, then the same
prompts unconstrained with each request's token count set to what its constrained run made, so both arms step the
same rows for the same number of steps. A step's time is a request's decode wall over its tokens after the first
(`Timings`), the median over the requests, then over --runs runs of each arm taken in turn.

Speculative rounds (--spec dflash --draft-acceptance 0.596): the controlled drafter (`engine/runtime/drafting/
controlled.py`) drafts K (--draft-tokens 7) every round from a first pass's recorded output, spoiled at the set
rate; a first pass of each arm records, then --runs passes measure. Accepted drafts per K drafted under the schema
against unconstrained on the same prompts: a draft the grammar refuses ends its round's drafts (a spoiled one, or
a right one the grammar would not allow), so the schema should keep the acceptance where it leaves the text free.

Usage: python scripts/bench_grammar_step.py [--model synthetic:tiny] [--device cpu] [--tokens 64] [--spec none]
  e.g. --model synthetic:qwen3.6-27b --device cuda --weights q5/q4 --kv int8 (--spec dflash --draft-acceptance 0.596)
  -> table + scripts/results/bench_grammar_step_<gpu or cpu>.json (or $OUT/)
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
from dataclasses import replace
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench_concurrency import PROMPTS, WEIGHTS, in_thread  # noqa: E402
from bench_grammar import SCHEMA  # noqa: E402
from bench_util import write_results  # noqa: E402

from engine import Engine, EngineConfig, SamplingParams  # noqa: E402
from engine.runtime.request import FinishEvent, Grammar  # noqa: E402


def run_together(eng: Engine, prompts: list[list[int]], params: list[SamplingParams]) -> list[FinishEvent]:
    """Every prompt at once, a thread each (as the API server runs requests); their FinishEvents in order."""
    finals: list[FinishEvent | None] = [None] * len(prompts)

    def one(i: int) -> None:
        finals[i] = eng.complete(prompts[i], params[i])

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return finals


def step_ms(finals: list[FinishEvent]) -> float:
    """The median request's decode wall per token after its first: one step each, with the others' rows in it."""
    return statistics.median(1e3 * f.timings.decode_s / f.timings.decode_steps for f in finals)


def acceptance(finals: list[FinishEvent], k: int) -> dict:
    """The requests' rounds summed: accepted drafts per K drafted (the controlled drafter's setting; the grammar cuts
    a round's drafts at the first it refuses, so SpecStats' accepted / drafted counts only what it let through,
    kept here as `of_checked`), and the tokens a round yields (its accepted drafts + the target's pick)."""
    rounds = sum(f.spec.rounds for f in finals)
    drafted = sum(f.spec.drafted for f in finals)
    accepted = sum(f.spec.accepted for f in finals)
    return {"rounds": rounds, "drafted": drafted, "accepted": accepted, "acceptance": accepted / (rounds * k),
            "of_checked": accepted / drafted, "tokens_per_round": (accepted + rounds) / rounds}


def arms(eng: Engine, prompts: list[list[int]], tokens: int) -> tuple[list[SamplingParams], list[SamplingParams],
                                                                      list[int]]:
    """The constrained requests' parameters and the unconstrained ones that make as many tokens each (a warm-up
    pass of the constrained ones finds those counts: the grammar ends an output when its JSON is complete)."""
    schema = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True,
                            grammar=Grammar("json_schema", json.dumps(SCHEMA)))
    made = [f.completion_tokens for f in run_together(eng, prompts, [schema] * len(prompts))]
    return [schema] * len(prompts), [replace(schema, grammar=None, max_tokens=m) for m in made], made


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="synthetic:tiny", help="model path or synthetic:PRESET")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--tokens", type=int, default=64, help="tokens a request makes at most (a schema may end sooner)")
    ap.add_argument("--sizes", default="1,8", help="how many requests at once")
    ap.add_argument("--runs", type=int, default=3, help="measured runs of each arm (the median is kept)")
    ap.add_argument("--weights", default="auto", choices=sorted(WEIGHTS))
    ap.add_argument("--kv", default="auto", help="kv_dtype")
    ap.add_argument("--max-context", type=int, default=4096)
    ap.add_argument("--no-graphs", action="store_true", help="eager steps on a GPU (graphs never run on the CPU)")
    ap.add_argument("--spec", default="none", choices=("none", "dflash"), help="dflash: acceptance under a schema")
    ap.add_argument("--draft-tokens", type=int, default=7)
    ap.add_argument("--drafter", default="", help="the DFlash drafter (default for synthetic:P: synthetic:dflash-P)")
    ap.add_argument("--draft-acceptance", type=float, default=0.596, help="the controlled drafter's acceptance")
    args = ap.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    drafter = args.drafter
    if args.spec == "dflash" and not drafter and args.model.startswith("synthetic:"):
        drafter = "synthetic:dflash-" + args.model.removeprefix("synthetic:")
    spec = args.spec == "dflash"
    config = EngineConfig(args.model, device=args.device, max_concurrency=max(sizes), held_sequences=0,
                          weights=WEIGHTS[args.weights], kv_dtype=args.kv, max_context=args.max_context,
                          cuda_graphs=args.device == "cuda" and not args.no_graphs, spec=args.spec,
                          draft_tokens=args.draft_tokens, drafter=drafter,
                          draft_acceptance=args.draft_acceptance if spec else 0.0,
                          adaptive_drafts=False)  # K drafts every round: acceptance of K-token rounds
    eng = in_thread(Engine, config)  # as `ninfer serve` loads: in a thread that ends after the load
    encoded = [eng.tokenizer.encode(p, add_special=True) for p in PROMPTS]
    gpu = torch.cuda.get_device_name() if args.device == "cuda" else None
    rows = []
    for n in sizes:
        prompts = [encoded[i % len(encoded)] for i in range(n)]
        schema, free, made = arms(eng, prompts, args.tokens)
        row = {"device": args.device, "gpu": gpu, "model": Path(args.model).name, "weights": args.weights,
               "kv_dtype": args.kv, "cuda_graphs": config.cuda_graphs, "spec": args.spec, "requests": n,
               "tokens_made": made}
        if spec:
            # the controlled drafter's table is filled by a pass at this concurrency (`arms` recorded the schema's
            # outputs; this records the free ones), and the measured passes draft from it; its spoiled drafts are
            # random, so the rounds of all runs are summed
            run_together(eng, prompts, free)
            finals: dict[str, list[FinishEvent]] = {"schema": [], "free": []}
            for _ in range(args.runs):
                finals["schema"] += run_together(eng, prompts, schema)
                finals["free"] += run_together(eng, prompts, free)
            assert [f.completion_tokens for f in finals["free"]] == made * args.runs, "the free arm made other counts"
            got = {arm: acceptance(f, args.draft_tokens) for arm, f in finals.items()}
            row |= {"draft_tokens": args.draft_tokens, "draft_acceptance": args.draft_acceptance, "runs": args.runs,
                    "schema": got["schema"], "free": got["free"]}
            print(f"{n} requests, K={args.draft_tokens} at {args.draft_acceptance}: "
                  + ", ".join(f"{arm} {g['acceptance']:.3f} accepted per draft ({g['of_checked']:.3f} of those "
                              f"verified), {g['tokens_per_round']:.2f} tokens/round"
                              for arm, g in got.items()))
        else:
            run_together(eng, prompts, free)  # warm-up of the unconstrained arm
            times: dict[str, list[float]] = {"schema": [], "free": []}
            for _ in range(args.runs):  # the arms in turn, so drift in the machine's speed falls on both
                times["schema"].append(step_ms(run_together(eng, prompts, schema)))
                times["free"].append(step_ms(run_together(eng, prompts, free)))
            ms_schema, ms_free = statistics.median(times["schema"]), statistics.median(times["free"])
            row |= {"runs": args.runs, "step_ms_schema": ms_schema, "step_ms_free": ms_free,
                    "overhead": ms_schema / ms_free - 1, "step_ms_schema_runs": times["schema"],
                    "step_ms_free_runs": times["free"]}
            print(f"{n} requests, {min(made)}-{max(made)} tokens each: {ms_schema:7.2f} ms/step under the schema, "
                  f"{ms_free:7.2f} ms/step without: overhead {row['overhead']:+.1%} of the step")
        rows.append(row)
    name = "bench_grammar_step" if args.spec == "none" else f"bench_grammar_step_{args.spec}"
    print("wrote", write_results(name, rows, tag="cpu" if args.device == "cpu" else None))


if __name__ == "__main__":
    main()
