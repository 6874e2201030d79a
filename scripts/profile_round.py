"""Where a speculative round's time goes on the device timeline, with CUDA graphs, as the engine runs it: CUDA
events recorded on the stream around each piece of `generate`'s round (the drafter's propose, the verify step,
the acceptance that ends in the round's one host sync, the commit that rolls the state back, the drafter's
observe of the accepted tokens). Between two events the interval is the device's time there, idle included: an
interval longer than its graph's replay is host time that the device waited for. The host's time between the
same two points is printed beside it.

`synthetic:qwen3.6-27b`, 8k-speed formats (q5 attention/GDN, q4 MLP, q8 embeddings/head), int8 KV, 8K context;
random weights reject every draft, so each round keeps one token (the cost of a round hardly depends on it).

Usage: python scripts/profile_round.py [--drafters dflash,mtp] -> table + scripts/results/profile_round_<gpu>.json
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections import defaultdict
from dataclasses import replace
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench_spec import CONTEXT, FORMATS  # noqa: E402
from bench_util import gpu_name, kernel_times, write_results  # noqa: E402

from engine import Engine, EngineConfig, SamplingParams  # noqa: E402
from engine.config import WEIGHT_LAYOUTS  # noqa: E402
from engine.runtime import generate as gen_module  # noqa: E402
from engine.runtime.drafting.drafters import make_drafter  # noqa: E402
from engine.runtime.lanes import Lanes  # noqa: E402
from engine.runtime.runner import GraphRunner  # noqa: E402
from engine.runtime.sampler import Sampler  # noqa: E402


class Marks:
    """(label, event, host time) recorded on the current stream in host order; a round starts at each
    `start_label`."""

    def __init__(self) -> None:
        self.marks: list[tuple[str, torch.cuda.Event, float]] = []
        self.ranges = False  # also a profiler range per piece (the kernels run), so kernels are told apart by piece

    def mark(self, label: str) -> None:
        e = torch.cuda.Event(enable_timing=True)
        e.record()
        self.marks.append((label, e, time.perf_counter()))

    def wrap(self, obj, name: str, label: str, only=None) -> None:
        """Mark before and after `obj.name(...)` (when `only(*args, **kwargs)` says so)."""
        fn = getattr(obj, name)

        def wrapped(*args, **kwargs):
            if only is not None and not only(*args, **kwargs):
                return fn(*args, **kwargs)
            return self.span(label, fn, *args, **kwargs)

        setattr(obj, name, wrapped)

    def span(self, label: str, fn, *args, **kwargs):
        self.mark(label + " <")
        if self.ranges:
            with torch.profiler.record_function(label):
                out = fn(*args, **kwargs)
        else:
            out = fn(*args, **kwargs)
        self.mark(label + " >")
        return out

    def intervals(self, start_label: str) -> tuple[dict[str, float], dict[str, float], list[float]]:
        """Median ms per interval label ("a > .. b <" for what lies between pieces) over the whole rounds, on the
        device and on the host (a host interval as long as the device's says the host was not ahead there), and
        each round's ms."""
        torch.cuda.synchronize()
        starts = [i for i, (label, _, _) in enumerate(self.marks) if label == start_label]
        per: dict[str, list[float]] = defaultdict(list)
        host: dict[str, list[float]] = defaultdict(list)
        rounds = []
        for a, b in zip(starts, starts[1:], strict=False):
            total = 0.0
            for (la, ea, ha), (lb, eb, hb) in zip(self.marks[a:b], self.marks[a + 1:b + 1], strict=True):
                ms = ea.elapsed_time(eb)
                key = la[:-2] if la.endswith(" <") and lb == la[:-2] + " >" else f"{la} .. {lb}"
                per[key].append(ms)
                host[key].append((hb - ha) * 1e3)
                total += ms
            rounds.append(total)
        median = {k: statistics.median(v) for k, v in per.items()}
        return median, {k: statistics.median(v) for k, v in host.items()}, rounds


def kernels_per_round(prof, rounds: int) -> list[dict]:
    """The kernels the profiler saw (inside graphs too), device us and launches per round, largest first."""
    per = kernel_times(prof, rounds)
    return [{"name": n[:100], "us": v[0], "launches": v[1]} for n, v in sorted(per.items(), key=lambda kv: -kv[1][0])]


def kernels_by_piece(prof, rounds: int, labels: set[str]) -> dict[str, list[dict]]:
    """Each piece's kernels (those launched inside its profiler range, graph replays included), device us and
    launches per round, largest first."""
    per: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(lambda: [0.0, 0.0]))

    def walk(ev, label: str) -> None:
        for k in ev.kernels:
            per[label][k.name][0] += k.duration / rounds
            per[label][k.name][1] += 1 / rounds
        for child in ev.cpu_children:
            walk(child, label)

    for ev in prof.events():
        if ev.name in labels:
            walk(ev, ev.name)
    return {label: [{"name": n[:100], "us": v[0], "launches": v[1]}
                    for n, v in sorted(kerns.items(), key=lambda kv: -kv[1][0])] for label, kerns in per.items()}


def profile(eng: Engine, cache, drafter, k: int, prompt: list[int], new: int, kernels: bool,
            temperature: float) -> dict:
    runner = GraphRunner(eng.model, Lanes([cache]), (1, k + 1) if k else (1,), drafter)
    runner.capture_all()
    marks = Marks()
    cache.reset()
    # sampled rounds filter as the 8k-speed profile does (top-k 20, top-p 0.95)
    params = SamplingParams(max_tokens=new, temperature=temperature, top_k=20 if temperature else 0,
                            top_p=0.95 if temperature else 1.0, ignore_eos=True, seed=0)
    run = lambda: list(gen_module.generate(runner, eng.tokenizer, prompt, params, cache, 1024,  # noqa: E731
                                           drafter=drafter, draft_tokens=k))
    run()  # one-time costs (the prefill's first chunks, the sampler's first kernels) stay out of the timed run
    t = k + 1 if k else 1
    marks.wrap(runner, "forward", "verify" if k else "step", only=lambda ids, *a, **kw: ids.shape[0] == t)
    marks.wrap(cache, "commit", "commit")
    if drafter is not None:
        marks.wrap(drafter, "propose", "propose")
        marks.wrap(drafter, "observe", "observe")
    accept, pick = Sampler.accept, Sampler.pick
    Sampler.accept = lambda s, *a: marks.span("accept", accept, s, *a)
    Sampler.pick = lambda s, *a: marks.span("pick", pick, s, *a)
    try:
        cache.reset()
        run()
        per, host, each = marks.intervals("propose <" if drafter is not None else "step <")
        # the mean beside the median: a few slow rounds (those that keep drafts, say) move only the mean
        out = {"round_ms": statistics.median(each), "round_ms_mean": statistics.fmean(each),
               "round_ms_max": max(each), "rounds": len(each), "intervals_ms": per, "host_intervals_ms": host}
        if kernels:  # a third run, decode rounds only, under the profiler (whose hooks slow the host: no timeline)
            marks.marks.clear()
            marks.ranges = True
            cache.reset()
            gen = gen_module.generate(runner, eng.tokenizer, prompt, params, cache, 1024, drafter=drafter,
                                      draft_tokens=k)
            next(gen)
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                    torch.profiler.ProfilerActivity.CUDA]) as prof:
                final = list(gen)[-1]
                torch.cuda.synchronize()
            n = final.spec.rounds if final.spec else final.timings.decode_steps
            out["kernels"] = kernels_per_round(prof, n)
            out["kernels_by_piece"] = kernels_by_piece(prof, n, {"verify", "step", "accept", "pick", "commit",
                                                                 "propose", "observe"})
    finally:
        Sampler.accept, Sampler.pick = accept, pick
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--drafters", default="dflash,mtp")
    p.add_argument("--new", type=int, default=40)
    p.add_argument("--context", type=int, default=CONTEXT)
    p.add_argument("--layout", choices=WEIGHT_LAYOUTS, default="auto")
    p.add_argument("--temperature", type=float, nargs="+", default=[0.0])
    p.add_argument("--kernels", action="store_true", help="also the kernels per round, under torch's profiler")
    p.add_argument("--draft-vocab", type=int, default=0, help="the drafters' draft_vocab (0: every token)")
    args = p.parse_args()
    config = EngineConfig("synthetic:qwen3.6-27b", device="cuda", weights=FORMATS, weight_layout=args.layout,
                          kv_dtype="int8", max_context=args.context + 256, spec="mtp", held_sequences=0,
                          cuda_graphs=False)
    eng = Engine(config)
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, 200000, (args.context,), generator=g).tolist()
    cache = eng.model.new_cache(eng.max_context)
    rows = []
    cases = [("none", None, 0)] + [
        (name, make_drafter(replace(config, spec=name, drafter="synthetic:dflash-qwen3.6-27b", cuda_graphs=True,
                                    draft_vocab=args.draft_vocab), eng.model), 7 if name == "dflash" else 3)
        for name in args.drafters.split(",")]
    for temperature in args.temperature:
        for name, drafter, k in cases:
            r = profile(eng, cache, drafter, k, prompt, args.new, args.kernels, temperature)
            r.update({"gpu": gpu_name(), "spec": name, "draft_vocab": args.draft_vocab, "K": k,
                      "context": args.context, "layout": args.layout,
                      "temperature": temperature, "path": "cuda graphs, device timeline between CUDA events"})
            rows.append(r)
            print(f"\n== {name} K={k}, temperature {temperature}: round {r['round_ms']:.3f} ms "
                  f"(median of {r['rounds']}; mean {r['round_ms_mean']:.3f}, max {r['round_ms_max']:.3f})")
            print(f"  {'':40s} {'device':>9s}    {'host':>9s}")
            for label, ms in r["intervals_ms"].items():
                print(f"  {label:40s} {ms * 1e3:9.1f} us {r['host_intervals_ms'][label] * 1e3:9.1f} us")
            for kern in r.get("kernels", [])[:25]:
                print(f"    {kern['us']:8.1f} us x{kern['launches']:6.1f}  {kern['name'][:90]}")
            for piece, kerns in r.get("kernels_by_piece", {}).items():
                print(f"  {piece}: {sum(k['us'] for k in kerns):8.1f} us of kernels in "
                      f"{sum(k['launches'] for k in kerns):5.1f} launches")
                for kern in kerns[:8]:
                    print(f"    {kern['us']:8.1f} us x{kern['launches']:6.1f}  {kern['name'][:90]}")
    print("wrote", write_results("profile_round", rows))


if __name__ == "__main__":
    main()
