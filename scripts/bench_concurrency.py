"""Concurrent requests against one engine: N requests at once (their plain decode steps batched) against the same N
requests one after another, in the same run. Wall time and aggregate tok/s of each, the speed-up, and how many
steps ran batched. Defaults to the embedded model on the CPU (no CUDA graphs: each request has a cache of its own);
on a GPU the requests run in lanes and their steps replay batch buckets' CUDA graphs (`--no-graphs`: eager steps).
With graphs, also the device-bound rate measured in the same run: N tokens per replay of the graph that serves
N requests (device events, median of 30), which the requests' rate would reach if the host cost nothing and the
prefills took no time.

Usage: python scripts/bench_concurrency.py [--model PATH] [--device cpu] [--tokens 64] [--weights q5/q4]
  e.g. --model synthetic:qwen3.6-27b --device cuda --weights q5/q4 --kv int8 (the multi-user profile's settings)
  -> table + scripts/results/bench_concurrency_<device>.json (or $OUT/)
--profile (GPU): each size's requests at once again under the torch profiler: device time per step by kernel, and
the share of the wall the device was busy (-> bench_concurrency_profile_<gpu>.json)
--step-times: each pass at once, its steps' wall times (the slow ones) and the drafter graphs captured during it
--confident-target: a synthetic target whose greedy picks win by a wide margin (an adaptive run keeps the benchmark
drafter's acceptance; see `confident_target`)
"""
from __future__ import annotations

import argparse
import os
import platform
import sys
import threading
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench_util import kernel_times, write_results  # noqa: E402

from engine import Engine, EngineConfig, SamplingParams  # noqa: E402
from engine.config import WeightFormats  # noqa: E402
from engine.kernels.timing import median_ms  # noqa: E402
from engine.runtime.drafting.controlled import ControlledDrafter  # noqa: E402

WEIGHTS = {"auto": WeightFormats(), "q5/q4": WeightFormats(attn="q5", gdn="q5", mlp="q4", embed="q8", lm_head="q8")}

PROMPTS = ("Write a haiku about autumn leaves.", "Explain what a hash map is in two sentences.",
           "def quicksort(xs):", "List three uses of copper.", "The capital of France is",
           "Translate 'good morning' into Spanish.", "What is 17 times 23?", "Name a prime number above 100.")


def in_thread(fn, *args):
    """fn(*args) in a thread of its own (which then ends), as the server runs loads and requests."""
    out = []
    t = threading.Thread(target=lambda: out.append(fn(*args)))
    t.start()
    t.join()
    return out[0]


def run_all(eng: Engine, prompts: list[list[int]], params: SamplingParams, together: bool) -> float:
    """Wall seconds to finish every prompt, all at once or one after another (in one thread). At once, every
    request is queued before the engine's loop takes its next step, so each pass starts them in the same step;
    and the benchmark drafter's random draws start again from its seed: passes of one workload then batch alike
    and round alike, so the recording pass's continuation is what the measured pass produces (a row's kernels
    follow the rows beside it, and on random weights another batching continues otherwise)."""
    if isinstance(eng.drafter, ControlledDrafter):
        eng.drafter.rng.seed(0)
    t0 = time.perf_counter()
    if together:
        with eng.core.scheduler.lock:
            streams = [eng.submit(p, params) for p in prompts]
        for stream in streams:
            for _ in stream:
                pass
    else:
        in_thread(lambda: [eng.complete(p, params) for p in prompts])
    return time.perf_counter() - t0


def measured_acceptance(eng: Engine, prompt: list[int], params: SamplingParams) -> float | None:
    """The drafts' acceptance (accepted / drafted) of one request of the workload, or None without a drafter."""
    spec = eng.complete(prompt, params).spec
    return spec.acceptance_rate if spec is not None else None


def device_step_ms(eng: Engine, n: int) -> float | None:
    """Device time of the graph that steps n running requests."""
    return median_ms(eng.runner.decode_graph(n).replay, 30, warmup=3) if eng.runner is not None else None


def profile(eng: Engine, prompts: list[list[int]], params: SamplingParams, row: dict) -> None:
    """The requests at once under the profiler: each kernel's device time per step, and the device's busy share."""
    steps = eng.core.steps
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        wall = run_all(eng, prompts, params, together=True)
    steps = eng.core.steps - steps
    kernels = kernel_times(prof, steps)
    busy = sum(us for us, _ in kernels.values())
    top = sorted(kernels.items(), key=lambda kv: -kv[1][0])[:25]
    print(f"profile: {len(prompts)} requests, {steps} steps, wall {wall * 1e3 / steps:.2f} ms/step, device busy "
          f"{busy / 1e3:.2f} ms/step ({busy / 1e3 / (wall * 1e3 / steps):.0%})")
    for name, (us, launches) in top:
        print(f"  {us:9.1f} us {launches:7.1f} launches  {name[:110]}")
    write_results("bench_concurrency_profile", {**row, "profile_steps": steps, "wall_ms_per_step": wall * 1e3 / steps,
                                                "device_busy_ms_per_step": busy / 1e3,
                                                "kernels": {n: {"us_per_step": us, "launches_per_step": la}
                                                            for n, (us, la) in top}})


def confident_target(scale: float = 0.01) -> None:
    """--confident-target: a synthetic model's greedy picks by a wide margin, its speed unchanged. On random weights
    the target's logits are nearly flat, so a plain step and a verify step (other kernels for other row counts)
    pick differently at near ties, and an adaptive run, which mixes them, leaves the continuation the benchmark
    drafter recorded (its acceptance falls toward 0 whatever it is set to). Here each layer's output projection is
    scaled down (the residual stream stays near the token's embedding) and the head's row of token j is the
    embedding of token perm[j]: the next token is perm^-1 of the last, ahead of every other by ~70 logits against
    a spread of ~1. Every kernel still runs on the same shapes and formats."""
    from engine.loaders import synthetic

    plain = synthetic.random_weights

    def weights(shapes, dtype, device, seed=0, transform=None):
        kept: dict[str, torch.Tensor] = {}

        def confident(name: str, t: torch.Tensor) -> torch.Tensor:
            if name == "embed_tokens.weight":
                kept["embed"] = t
            elif name == "lm_head.weight":
                perm = torch.randperm(t.shape[0], generator=torch.Generator().manual_seed(seed)).to(t.device)
                t = kept.pop("embed")[perm]
            elif name.endswith(("o_proj.weight", "down_proj.weight", "out_proj.weight")):
                t = t * scale
            return transform(name, t) if transform else t

        return plain(shapes, dtype, device, seed, confident)

    synthetic.random_weights = weights


class StepTimes:
    """--step-times: the wall time of every engine-core step of a pass (the loop's `step` wrapped here), and the
    drafter graphs captured during it: where a pass is slower than its steps' medians say, which steps were."""

    def __init__(self, eng: Engine) -> None:
        from engine.runtime.core import EngineCore

        self.eng, self.times = eng, []
        step = EngineCore.step

        def timed(core) -> bool:
            t0 = time.perf_counter()
            try:
                return step(core)
            finally:
                self.times.append(time.perf_counter() - t0)

        EngineCore.step = timed

    def captures(self) -> int:
        graphs = getattr(self.eng.drafter, "graphs", None)
        return graphs.captures if graphs is not None else 0

    def summary(self, since: int, captured: int) -> dict:
        ms = sorted(1e3 * t for t in self.times[since:])
        if not ms:
            return {}
        p50 = ms[len(ms) // 2]
        return {"steps": len(ms), "p50_ms": p50, "p99_ms": ms[min(len(ms) - 1, int(0.99 * len(ms)))],
                "max_ms": ms[-1], "over_3x_p50": sum(m > 3 * p50 for m in ms),
                "over_3x_p50_ms": sum(m for m in ms if m > 3 * p50), "drafter_captures": self.captures() - captured}


def rate(value: float | None) -> str:
    """An acceptance for the table: '-' where no draft was made."""
    return "-" if value is None else f"{value:.2f}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="model path or name (default: the embedded SmolLM2-135M)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--tokens", type=int, default=64, help="tokens generated per request")
    ap.add_argument("--sizes", default="1,2,4,8", help="how many requests at once")
    ap.add_argument("--weights", default="auto", choices=sorted(WEIGHTS))
    ap.add_argument("--kv", default="auto", help="kv_dtype")
    ap.add_argument("--max-context", type=int, default=8192)
    ap.add_argument("--no-graphs", action="store_true", help="eager steps on a GPU (graphs never run on the CPU)")
    ap.add_argument("--spec", default="none", help="drafter: none, ngram, mtp or dflash (with --drafter)")
    ap.add_argument("--draft-tokens", type=int, default=4)
    ap.add_argument("--drafter", default="", help="the DFlash drafter checkpoint (or synthetic:PRESET)")
    ap.add_argument("--fixed-drafts", action="store_true", help="draft_tokens every round (adaptive_drafts off)")
    ap.add_argument("--draft-acceptance", type=float, default=0.0,
                    help="the benchmark drafter's acceptance (0: the drafter's own guesses); the warm-up records "
                    "the target's greedy output, which the measured runs then draft from")
    ap.add_argument("--profile", action="store_true", help="kernel times per step of each size (GPU)")
    ap.add_argument("--step-times", action="store_true",
                    help="each pass at once: its steps' wall times (p50/p99/max, the slow ones) and the drafter "
                    "graphs captured during it")
    ap.add_argument("--confident-target", action="store_true",
                    help="a synthetic target whose greedy picks win by a wide margin (`confident_target`): an "
                    "adaptive run keeps the benchmark drafter's acceptance")
    args = ap.parse_args()
    if args.confident_target:
        confident_target()
    if args.model is None:
        from ninfer_tui.models import resolve

        args.model = resolve("smollm2-135m", announce=False)
    sizes = [int(s) for s in args.sizes.split(",")]
    config = EngineConfig(args.model, device=args.device, max_concurrency=max(sizes), held_sequences=0,
                          weights=WEIGHTS[args.weights], kv_dtype=args.kv, max_context=args.max_context,
                          cuda_graphs=args.device == "cuda" and not args.no_graphs, spec=args.spec,
                          draft_tokens=args.draft_tokens, drafter=args.drafter,
                          draft_acceptance=args.draft_acceptance, adaptive_drafts=not args.fixed_drafts)
    eng = in_thread(Engine, config)  # as `ninfer serve` loads: in a thread that ends after the load
    steps = StepTimes(eng) if args.step_times else None
    params = SamplingParams(max_tokens=args.tokens, temperature=0, ignore_eos=True)
    encoded = [eng.tokenizer.encode(p, add_special=True) for p in PROMPTS]
    for p in encoded:  # warm-up: kernels chosen (and compiled) for every prompt's prefill; the whole output
        in_thread(eng.complete, p, params)  # recorded for the benchmark drafter
    rows = []
    for n in sizes:
        prompts = [encoded[i % len(encoded)] for i in range(n)]
        alone = run_all(eng, prompts, params, together=False)
        acceptance = measured_acceptance(eng, prompts[0], params)
        if args.draft_acceptance and n > 1:
            # the benchmark drafter's table is keyed by context: requests batched together may round otherwise than
            # alone (other kernels for more rows) and continue otherwise on random weights, so their continuation
            # is recorded by a pass at the same concurrency first
            run_all(eng, prompts, params, together=True)
        before = eng.stats()["batched_steps"]
        verifies = eng.runner.verify_replays if eng.runner is not None else 0
        drafted, accepted = eng.core.drafted, eng.core.accepted
        since, captured = (len(steps.times), steps.captures()) if steps is not None else (0, 0)
        together = run_all(eng, prompts, params, together=True)
        drafted = eng.core.drafted - drafted
        tokens = n * args.tokens
        step_ms = device_step_ms(eng, n)
        bound = n * 1e3 / step_ms if step_ms else None
        rows.append({"device": args.device, "machine": platform.processor() or platform.machine(),
                     "threads": os.cpu_count(), "model": Path(args.model).name, "weights": args.weights,
                     "kv_dtype": args.kv, "spec": args.spec, "draft_tokens": config.draft_tokens,
                     "draft_acceptance": args.draft_acceptance, "acceptance": acceptance,
                     # what the requests at once kept: below `acceptance` where their output left the recorded one
                     "acceptance_at_once": (eng.core.accepted - accepted) / drafted if drafted else None,
                     "adaptive_drafts": config.adaptive_drafts, "confident_target": args.confident_target,
                     "cuda_graphs": config.cuda_graphs, "lanes": eng.stats()["lanes"],
                     "gpu": torch.cuda.get_device_name() if args.device == "cuda" else None, "requests": n,
                     "tokens_per_request": args.tokens, "sequential_s": alone, "concurrent_s": together,
                     "sequential_tok_s": tokens / alone, "concurrent_tok_s": tokens / together,
                     "speedup": alone / together, "vs_one_alone": together / (alone / n),
                     "batched_steps": eng.stats()["batched_steps"] - before,
                     # steps that ran several requests' verify rows in one graph
                     "verify_graph_steps": (eng.runner.verify_replays - verifies) if eng.runner is not None else 0,
                     # adaptive drafts: the step times the choice compared at n running requests, and its steps
                     # of each kind, over every pass so far
                     "draft_choice": eng.stats()["draft_choice"].get(str(n)),
                     "step_times": steps.summary(since, captured) if steps is not None else None,
                     "device_step_ms": step_ms, "device_bound_tok_s": bound,
                     "of_device_bound": tokens / together / bound if bound else None})
        r = rows[-1]
        print(f"{n} requests x {args.tokens} tokens: one after another {alone:6.2f} s ({r['sequential_tok_s']:6.1f}"
              f" tok/s), at once {together:6.2f} s ({r['concurrent_tok_s']:6.1f} tok/s) = {r['speedup']:4.2f}x, "
              f"{r['vs_one_alone']:4.2f}x the time of one alone, "
              f"{r['batched_steps']} batched steps ({r['verify_graph_steps']} batch verify graphs)"
              + (f", acceptance {rate(acceptance)} alone, {rate(r['acceptance_at_once'])} at once"
                 if r["acceptance_at_once"] is not None else "")
              + (f"; device-bound {bound:6.1f} tok/s ({step_ms:.2f} ms/step), at once = "
                 f"{r['of_device_bound']:.0%} of it" if bound else ""))
        if r["draft_choice"]:
            c = r["draft_choice"]
            print(f"  the load choice at {n}: drafting steps {c['drafting_ms']} ms ({c['drafting_steps']}), plain "
                  f"{c['plain_ms']} ms ({c['plain_steps']})")
        if r["step_times"]:
            st = r["step_times"]
            print(f"  steps at once: {st['steps']}, p50 {st['p50_ms']:.2f} ms, p99 {st['p99_ms']:.2f}, max "
                  f"{st['max_ms']:.2f}; {st['over_3x_p50']} over 3x p50 ({st['over_3x_p50_ms']:.0f} ms); drafter "
                  f"graphs captured {st['drafter_captures']}")
        if args.profile and args.device == "cuda":
            profile(eng, prompts, params, r)
    name = "bench_concurrency" if args.spec == "none" else f"bench_concurrency_{args.spec}"
    name += "_fixed" if args.spec != "none" and args.fixed_drafts else ""
    name += "_confident" if args.confident_target else ""
    print("wrote", write_results(name, rows, tag="cpu" if args.device == "cpu" else None))


if __name__ == "__main__":
    main()
