"""Where a decode round's device time goes: per-kernel device time of generation rounds on
`synthetic:qwen3.6-27b` (8k-speed formats, int8 KV, 8K context), eager so every kernel is seen, for plain decode,
MTP K=3 and DFlash K=7 rounds; plus the CUDA-graph replay time of the T=1 and T=K+1 steps, whose difference from
the kernel sum is what launches and gaps cost.

Usage: python scripts/profile_step.py [--new 16] -> table + scripts/results/profile_step_<gpu>.json (or $OUT/)
"""
from __future__ import annotations

import argparse
import re
import sys
from collections import defaultdict
from dataclasses import replace
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench_spec import CONTEXT, FORMATS  # noqa: E402
from bench_util import fill_cache, gpu_name, kernel_times, time_ms, write_results  # noqa: E402

from engine import Engine, EngineConfig, SamplingParams  # noqa: E402
from engine.config import WEIGHT_LAYOUTS  # noqa: E402
from engine.runtime.drafting.drafters import make_drafter  # noqa: E402
from engine.runtime.generate import generate  # noqa: E402
from engine.runtime.lanes import Lanes  # noqa: E402
from engine.runtime.request import FinishEvent  # noqa: E402
from engine.runtime.runner import GraphRunner  # noqa: E402

# kernel name -> group; first match wins (Triton kernels are named after their jit function)
GROUPS = (("qmatmul tiled (CUDA)", r"qtiled"), ("qmatmul int8_dp4a", r"int8_dp4a_kernel"),
          ("qmatmul int8_mma_groups", r"int8_mma_groups_kernel"),
          ("qmatmul int8_mma", r"int8_mma_kernel"),
          ("qmatmul float_mma", r"float_mma_kernel"), ("split-K sum", r"sum_slices"),
          ("activation quantize", r"quantize"), ("rms norm (+add/gate/rope)", r"rms_norm"),
          ("silu * up", r"silu_mul"), ("conv1d step", r"conv_kernel"),
          ("gdn step", r"gdn|delta"), ("attention", r"attention|attn|flash|combine"), ("kv write", r"kv_write"),
          ("cuBLAS / gemm", r"gemm|gemv|cutlass|sm90|sm80|xmma|splitK"), ("conv1d", r"conv"),
          ("cat / copy", r"cat|copy|Copy"), ("reduce", r"reduce"), ("index / embedding", r"index|gather|embedding"),
          ("elementwise", r"elementwise"), ("sampling / sort", r"sort|topk|softmax|argmax|scan|multinomial"))


def group_of(name: str) -> str:
    return next((g for g, pat in GROUPS if re.search(pat, name)), "other")


def profile_rounds(eng: Engine, drafter, k: int, prompt: list[int], new: int) -> dict:
    """Kernel time per round of `new` generated tokens after an 8K prefill (the prefill is not profiled)."""
    cache = eng.model.new_cache(eng.max_context)
    params = SamplingParams(max_tokens=new, temperature=0, ignore_eos=True)
    cache.reset()  # a first run chooses the matmul tiles of these step sizes (timing kernels of its own)
    list(generate(eng.model, eng.tokenizer, prompt, params, cache, 1024, drafter=drafter, draft_tokens=k))
    cache.reset()
    gen = generate(eng.model, eng.tokenizer, prompt, params, cache, 1024, drafter=drafter, draft_tokens=k)
    next(gen)  # the prefill and the first token
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        final = [e for e in gen if isinstance(e, FinishEvent)][0]
        torch.cuda.synchronize()
    rounds = final.spec.rounds if final.spec else final.timings.decode_steps
    per_kernel = kernel_times(prof, rounds)
    groups: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    for name, (us, n) in per_kernel.items():
        groups[group_of(name)][0] += us
        groups[group_of(name)][1] += n
    top = sorted(per_kernel.items(), key=lambda kv: -kv[1][0])[:20]
    return {"rounds": rounds, "kernel_us_per_round": sum(v[0] for v in per_kernel.values()),
            "launches_per_round": sum(v[1] for v in per_kernel.values()),
            "groups": {g: {"us": v[0], "launches": v[1]} for g, v in sorted(groups.items(), key=lambda kv: -kv[1][0])},
            "top_kernels": [{"name": n[:90], "us": v[0], "launches": v[1]} for n, v in top]}


def graph_step_ms(eng: Engine, t: int, context: int) -> float:
    cache = eng.model.new_cache(context + 16)
    runner = GraphRunner(eng.model, Lanes([cache]), (t,))
    runner.capture_all()
    fill_cache(cache, context)
    ids = torch.randint(0, eng.geometry.vocab_size, (t,), device="cuda")

    def step():
        runner.forward(ids, cache, all_logits=t > 1, keep_inputs=t > 1)
        cache.length, cache.kept = context, None

    with torch.inference_mode():
        return time_ms(step, 30, warmup=3)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--new", type=int, default=16)
    p.add_argument("--context", type=int, default=CONTEXT)
    p.add_argument("--layout", choices=WEIGHT_LAYOUTS, default="auto",
                   help="the q4/q5 weight layout (auto: tiles, as the engine runs with a drafter)")
    args = p.parse_args()
    config = EngineConfig("synthetic:qwen3.6-27b", device="cuda", weights=FORMATS, weight_layout=args.layout,
                          kv_dtype="int8", max_context=args.context + 64, spec="mtp", held_sequences=0,
                          cuda_graphs=False)
    eng = Engine(config)
    drafters = {"none": (None, 0), "mtp K=3": (eng.drafter, 3),
                "dflash K=7": (make_drafter(replace(config, spec="dflash", drafter="synthetic:dflash-qwen3.6-27b"),
                                            eng.model), 7)}
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, 200000, (args.context,), generator=g).tolist()
    rows = []
    for name, (drafter, k) in drafters.items():
        r = profile_rounds(eng, drafter, k, prompt, args.new)
        r.update({"gpu": gpu_name(), "case": name, "path": "eager, per round", "context": args.context,
                  "layout": args.layout})
        rows.append(r)
        print(f"\n== {name}: {r['kernel_us_per_round'] / 1e3:.2f} ms of kernels, {r['launches_per_round']:.0f} "
              f"launches per round ({r['rounds']} rounds)")
        for gname, v in r["groups"].items():
            print(f"  {gname:24s} {v['us']:9.1f} us  {v['launches']:7.1f} launches")
        for kern in r["top_kernels"][:12]:
            print(f"    {kern['us']:9.1f} us  x{kern['launches']:6.1f}  {kern['name']}")
    for t in (1, 4, 8):
        ms = graph_step_ms(eng, t, args.context)
        rows.append({"gpu": gpu_name(), "case": f"graph step T={t}", "ms": ms, "context": args.context,
                     "layout": args.layout})
        print(f"graph replay T={t}: {ms:.2f} ms")
    print("wrote", write_results("profile_step" + ("" if args.layout == "auto" else f"_{args.layout}"), rows))


if __name__ == "__main__":
    main()
