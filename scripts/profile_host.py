"""Where a decode token's host time goes, with N requests at once on one engine: each piece of the per-token
path timed by wrapping it (perf_counter, summed over every thread), per token and sequence, beside the wall time
per step and the device-bound step (the graph's replay). On a GPU with CUDA graphs, the multi-user profile's
settings (q5/q4 weights, int8 KV). With --prefill, also where a prompt's prefill time goes (alone; in graphed
16-token pieces up to graph_prefill_tokens, with the eager wall time beside it): its wall time against the
device time of its kernels (torch.profiler), by kernel group.

Usage: python scripts/profile_host.py [--model synthetic:qwen3.6-27b] [--requests 1,8] [--tokens 64]
  [--prefill 16,128,1024] [--prefill-chunk 2048] [--py-profile 25]
  -> table on stdout + scripts/results/profile_host_<gpu>.json (or $OUT/)
"""
from __future__ import annotations

import argparse
import cProfile
import pstats
import sys
import threading
import time
from collections import defaultdict
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench_concurrency import PROMPTS, WEIGHTS, device_step_ms, in_thread, run_all  # noqa: E402
from bench_util import gpu_name, kernel_times, write_results  # noqa: E402
from profile_step import group_of  # noqa: E402

from engine import Engine, EngineConfig, SamplingParams, transfer  # noqa: E402
from engine.runtime import core, output, runner, sampler, scheduler  # noqa: E402
from engine.runtime.generate import generate  # noqa: E402

PIECES = {  # what is timed: (owner, attribute)
    "core.step (a whole step)": (core.EngineCore, "step"),
    "scheduler.plan (rows and drafts)": (scheduler.Scheduler, "plan"),
    "core._update (picks, verdicts, events)": (core.EngineCore, "_update"),
    "runner.forward (a lane's launch; prefill)": (runner.GraphRunner, "forward"),
    "runner.forward_batch (bucket launch)": (runner.GraphRunner, "forward_batch"),
    "sampler.pick": (sampler.Sampler, "pick"),
    "HostCopy() (queue the copy)": (transfer.HostCopy, "__init__"),
    "HostCopy.result (wait for the token)": (transfer.HostCopy, "result"),
    "output push (detokenize, stops)": (output.Output, "push"),
}
TOTALS: dict[str, float] = defaultdict(float)
LOCK = threading.Lock()


def wrap(name: str, owner, attr: str) -> None:
    inner = getattr(owner, attr)

    def timed(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return inner(*args, **kwargs)
        finally:
            dt = time.perf_counter() - t0
            with LOCK:
                TOTALS[name] += dt

    setattr(owner, attr, timed)


def run(eng: Engine, n: int, tokens: int) -> float:
    params = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True)
    prompts = [eng.tokenizer.encode(PROMPTS[i % len(PROMPTS)], add_special=True) for i in range(n)]
    return run_all(eng, prompts, params, together=True)


def profile_prefill(eng: Engine, n: int, py_profile: int = 0) -> dict:
    """Wall and kernel time of an n-token prompt's prefill in lane 0 (no request runs)."""
    ids = torch.randint(0, 240000, (n,), generator=torch.Generator().manual_seed(n)).tolist()
    cache = eng.lanes.caches[0]
    assert cache.kv.table.reserve(n + 16), "the KV pool lacks room for the prompt"  # a lane's blocks: per request

    target = eng.runner if eng.runner is not None else eng.model
    first = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)

    def once(model=target) -> float:
        cache.reset()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        with torch.inference_mode():
            list(generate(model, eng.tokenizer, ids, first, cache, eng.config.prefill_chunk))  # + first pick
        torch.cuda.synchronize()
        return time.perf_counter() - t0

    once()  # the matmuls' tiles chosen for these row counts
    walls = [once() for _ in range(3)]
    wall = min(walls)
    pieces = target.prefill_piece(min(n, eng.config.prefill_chunk))
    eager = min(once(eng.model) for _ in range(3)) if pieces else wall  # the same prompt in eager chunks
    host = None
    if py_profile:  # where the host time goes: the functions with the most time of their own
        prof_py = cProfile.Profile()
        prof_py.runcall(once)
        stats = pstats.Stats(prof_py)
        top = sorted(stats.stats.items(), key=lambda kv: -kv[1][2])[:py_profile]
        host = [{"function": f"{Path(f).name}:{line}({name})", "calls": nc, "own_ms": 1e3 * tt, "cum_ms": 1e3 * ct}
                for (f, line, name), (_, nc, tt, ct, _) in top]
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        once()
    groups: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    for name, (us, launches) in kernel_times(prof).items():
        groups[group_of(name)][0] += us / 1e3
        groups[group_of(name)][1] += launches
    cache.reset()
    cache.release()
    kernels = sum(v[0] for v in groups.values())
    return {"gpu": gpu_name(), "model": eng.model_name, "prompt_tokens": n, "prefill_wall_ms": 1e3 * wall,
            "prefill_walls_ms": [1e3 * w for w in walls], "graphed_pieces": pieces > 0,
            "eager_prefill_wall_ms": 1e3 * eager, "host_functions": host,
            "kernel_ms": kernels, "launches": sum(v[1] for v in groups.values()),
            "groups": {g: {"ms": v[0], "launches": v[1]} for g, v in sorted(groups.items(), key=lambda kv: -kv[1][0])}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="synthetic:qwen3.6-27b")
    ap.add_argument("--requests", default="1,8")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--prefill", default="", help="prompt lengths whose prefill to profile (GPU)")
    ap.add_argument("--prefill-chunk", type=int, default=None, metavar="N",
                    help="the engine's prefill_chunk (tokens a prefill step takes; default: the setting's)")
    ap.add_argument("--py-profile", type=int, default=0, metavar="N",
                    help="with --prefill: also the N Python functions with the most own time (cProfile)")
    args = ap.parse_args()
    sizes = [int(s) for s in args.requests.split(",")]
    chunk = {"prefill_chunk": args.prefill_chunk} if args.prefill_chunk else {}
    config = EngineConfig(args.model, device=args.device, max_concurrency=max(sizes), held_sequences=0,
                          weights=WEIGHTS["q5/q4"], kv_dtype="int8", max_context=8192, **chunk)
    eng = in_thread(Engine, config)
    run(eng, max(sizes), 8)  # warm-up
    for name, (owner, attr) in PIECES.items():
        wrap(name, owner, attr)
    rows = []
    for n in sizes:
        TOTALS.clear()
        wall = run(eng, n, args.tokens)
        steps = args.tokens
        step_ms = device_step_ms(eng, n)
        bound = f"{step_ms:.2f} ms" if step_ms is not None else "-"
        print(f"\n{n} requests x {args.tokens} tokens: {1e3 * wall / steps:.2f} ms per step (wall), device-bound "
              f"{bound}; per token and sequence:")
        row = {"gpu": gpu_name(), "model": args.model, "requests": n, "tokens": args.tokens,
               "wall_ms_per_step": 1e3 * wall / steps, "device_step_ms": step_ms}
        for name in PIECES:
            us = 1e6 * TOTALS[name] / (n * steps)
            row[name] = us
            print(f"  {name:42s} {us:8.1f} us")
        rows.append(row)
    for n in [int(s) for s in args.prefill.split(",") if s]:
        r = profile_prefill(eng, n, args.py_profile)
        rows.append(r)
        top = ", ".join(f"{g} {v['ms']:.1f} ms/{v['launches']}" for g, v in list(r["groups"].items())[:6])
        how = (f"graphed 16-token pieces (eager: {r['eager_prefill_wall_ms']:.1f} ms)" if r["graphed_pieces"]
               else "eager")
        print(f"\nprefill of {n} tokens, {how}: {r['prefill_wall_ms']:.1f} ms wall, kernels {r['kernel_ms']:.1f} ms in "
              f"{r['launches']} launches: {top}; walls {', '.join(f'{w:.0f}' for w in r['prefill_walls_ms'])} ms")
        for f in r["host_functions"] or []:
            print(f"  {f['own_ms']:8.1f} ms own {f['cum_ms']:8.1f} cum {f['calls']:6d} calls  {f['function']}")
    print("wrote", write_results("profile_host", rows, tag=None if args.device == "cuda" else "cpu"))


if __name__ == "__main__":
    main()
