"""Decode/verify step time of the engine on `synthetic:qwen3.6-27b` (or --model PATH) against the bandwidth floor
measured in the same run, and HF transformers (bf16, same config, same GPU, same run) as the baseline.

Per (weights, KV dtype, context, T): the cache holds `context` random tokens of KV and a random recurrent state
(fill_cache), one step of T tokens runs and is cut back, median of --reps device-event timings. The floor is the
bytes the step must read (weights, minus the embedding table of which T rows are read; the KV of the context;
the recurrent state read and written) over the device copy rate. Batch 2/4/8 rows time the model's batched step
(`forward_batch`, one token for each of B sequences, in a CUDA graph), as the engine's batch buckets replay it.
Also the prefill rate of an 8K prompt against the measured bf16 matmul rate.

Usage: python scripts/bench_decode.py [--quick]  -> table + scripts/results/bench_decode_<gpu>.json (or $OUT/)
"""
from __future__ import annotations

import argparse
import gc
import math
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench_util import copy_bandwidth, fill_cache, gpu_name, time_graph_ms, time_ms, write_results  # noqa: E402

from engine import Engine, EngineConfig  # noqa: E402
from engine.config import WeightFormats  # noqa: E402
from engine.loaders.synthetic import preset_spec  # noqa: E402
from engine.memory_plan import kv_bytes_per_token, recurrent_state_bytes  # noqa: E402
from engine.quant.formats import tensor_bytes  # noqa: E402
from engine.runtime.lanes import Lanes  # noqa: E402
from engine.runtime.runner import GraphRunner  # noqa: E402

_MIX = WeightFormats(attn="q5", gdn="q5", mlp="q4", embed="q8", lm_head="q8")
# (formats, weight_layout): "q5/q4 mix" row-major (the Triton matmuls; what the engine loads without a drafter),
# "q5/q4 tiles" the same formats tiled (the CUDA matmuls of `qtiled`; what it loads with one), "q8" every tensor
# in q8
MIXES = {"bf16": (WeightFormats.uniform("auto"), "auto"), "q8": (WeightFormats.uniform("q8"), "rows"),
         "q5/q4 mix": (_MIX, "rows"), "q5/q4 tiles": (_MIX, "tiles")}


def step_floor_bytes(eng: Engine, context: int, kv_dtype: str) -> int:
    g = eng.geometry
    weights = eng.plan.weights - tensor_bytes(g.vocab_size * g.hidden_size, eng.config.weights.embed, 2)
    kv = context * kv_bytes_per_token(g, kv_dtype, 2)
    conv, rec = recurrent_state_bytes(g, 2)
    return weights + kv + 2 * (conv + rec)


def time_step(model, cache, t: int, reps: int) -> float:
    """Median device time of one T-token step at the cache's length (cut back after each run); T > 1 is a verify
    step (all logits, per-step recurrent states kept)."""
    ids = torch.randint(0, model.geometry.vocab_size, (t,), device="cuda")
    context = cache.length

    def step():
        model.forward(ids, cache, all_logits=t > 1, keep_inputs=t > 1)
        cache.length, cache.kept = context, None

    with torch.inference_mode():
        return time_ms(step, reps, warmup=3)


def engine_rows(model: str, contexts: list[int], kv_dtypes: list[str], ts: list[int], reps: int, bw: float,
                weights: str, graphs: bool, prefill_chunks: list[int]) -> list[dict]:
    rows = []
    formats, layout = MIXES[weights]
    eng = Engine(EngineConfig(model, device="cuda", weights=formats, weight_layout=layout, max_context=16,
                              kv_dtype="int8", held_sequences=0, cuda_graphs=False))
    m = eng.model
    label = "ninfer (cuda graphs)" if graphs else "ninfer (eager)"
    for kv_dtype in kv_dtypes:
        m.kv_dtype = kv_dtype  # new caches take it; the weights stay
        for context in contexts:
            cache = m.new_cache(context + 16)
            runner = m
            if graphs:  # captured against this cache, before it is filled (capture resets it)
                runner = GraphRunner(m, Lanes([cache]), tuple(ts))
                runner.capture_all()
            fill_cache(cache, context)
            for t in ts:
                torch.cuda.reset_peak_memory_stats()
                ms = time_step(runner, cache, t, reps)
                floor = step_floor_bytes(eng, context, kv_dtype) / bw * 1e3
                rows.append({"engine": label, "gpu": gpu_name(), "model": model,
                             "weights": weights, "kv_dtype": kv_dtype, "context": context, "batch": 1, "T": t,
                             "ms_per_step": ms, "floor_ms": floor, "ratio_to_floor": ms / floor,
                             "tok_s": 1e3 / ms, "peak_mem_gib": torch.cuda.max_memory_allocated() / 2**30})
                print_row(rows[-1])
            del cache, runner
            gc.collect()
            torch.cuda.empty_cache()
            if graphs:
                rows += batch_rows(eng, context, kv_dtype, reps, bw, weights)
    for chunk in prefill_chunks:
        rows += prefill_rows(eng, bw, weights, chunk)
    del eng, m
    gc.collect()
    torch.cuda.empty_cache()
    return rows


def batch_rows(eng: Engine, context: int, kv_dtype: str, reps: int, bw: float, weights: str) -> list[dict]:
    """One decode token for each of B sequences at `context` (`forward_batch`, replayed as a CUDA graph): the
    weights are read once per step, each sequence's KV and recurrent state once. The engine replays this step as
    a batch bucket's graph when concurrent requests decode together (`runtime/runner.py`)."""
    m, g, rows = eng.model, eng.geometry, []
    per_sequence = context * kv_bytes_per_token(g, kv_dtype, 2) + 2 * sum(recurrent_state_bytes(g, 2))
    for batch in (2, 4, 8):
        caches = [m.new_cache(context + 16) for _ in range(batch)]
        for b, c in enumerate(caches):
            fill_cache(c, context, seed=b)
        step = _batch_step(m, caches, context)
        torch.cuda.reset_peak_memory_stats()
        with torch.inference_mode():
            ms = time_graph_ms(step, calls=1, reps=reps)
        floor = (step_floor_bytes(eng, context, kv_dtype) + (batch - 1) * per_sequence) / bw * 1e3
        rows.append({"engine": "ninfer (cuda graphs, model batch step)", "gpu": gpu_name(), "model": eng.model_name,
                     "weights": weights, "kv_dtype": kv_dtype, "context": context, "batch": batch, "T": 1,
                     "ms_per_step": ms, "floor_ms": floor, "ratio_to_floor": ms / floor, "tok_s": batch * 1e3 / ms,
                     "peak_mem_gib": torch.cuda.max_memory_allocated() / 2**30})
        print_row(rows[-1])
        del caches, step
        gc.collect()
        torch.cuda.empty_cache()
    return rows


def _batch_step(m, caches: list, context: int):
    ids = torch.randint(0, m.geometry.vocab_size, (len(caches),), device="cuda")
    positions = torch.full((len(caches),), context, device="cuda")

    def step():
        m.forward_batch(ids, caches, positions)
        for c in caches:
            c.length = context

    return step


def prefill_rows(eng: Engine, bw: float, weights: str, chunk: int) -> list[dict]:
    """An 8K prompt in pieces of `chunk` tokens (the profiles' prefill_chunk), against the bf16 matmul rate
    measured on the MLP shape, after a warm-up chunk. On bf16 weights with the GDN chunks through fla-core (when
    installed) and through the torch reference; on quantized ones (each matmul dequantizes blocks of rows, then
    multiplies) the default only."""
    from engine.kernels import gdn
    from engine.models import weight_shapes

    s = eng.geometry
    a = torch.randn(1024, s.hidden_size, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(s.intermediate_size, s.hidden_size, device="cuda", dtype=torch.bfloat16)
    mm_ms = time_ms(lambda: a @ w.t(), 20)
    mm_flops = 2 * a.shape[0] * w.shape[0] * w.shape[1] / (mm_ms / 1e3)
    ids = torch.randint(0, s.vocab_size, (8192,), device="cuda")
    rows = []
    usable = gdn.fla_usable  # put back after the torch path's row, or later weights would take it too
    has_fla = usable(torch.empty(1, device="cuda", dtype=torch.bfloat16))
    paths = ("fla-core", "torch") if has_fla else ("torch",)
    for name in paths if weights == "bf16" else paths[:1]:
        gdn.fla_usable = usable if name == "fla-core" else (lambda mixed: False)
        with torch.inference_mode():
            eng.model.forward(ids[:chunk], eng.model.new_cache(chunk))  # compilation and autotuning
            cache = eng.model.new_cache(8192 + 16)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for i in range(0, 8192, chunk):
                eng.model.forward(ids[i:i + chunk], cache)
            torch.cuda.synchronize()
        sec = time.perf_counter() - t0
        del cache
        params = sum(math.prod(shape) for n, shape in weight_shapes(s).items() if n != "embed_tokens.weight")
        flops = 2 * params * 8192 / sec  # weight FLOPs only (attention FLOPs excluded: a lower bound)
        gdn.fla_usable = usable
        rows.append({"engine": f"ninfer (eager, GDN chunks: {name})", "gpu": gpu_name(), "model": eng.model_name,
                     "phase": "prefill", "weights": weights, "prompt": 8192, "chunk": chunk, "seconds": sec,
                     "tok_s": 8192 / sec, "weight_tflops": flops / 1e12, "bf16_matmul_tflops": mm_flops / 1e12,
                     "ratio_to_matmul": flops / mm_flops})
        print(f"prefill 8K ({weights}, chunks of {chunk}, GDN: {name}): {sec:.2f} s = {8192 / sec:.0f} tok/s, "
              f"{flops / 1e12:.0f} TFLOP/s of weight matmuls = {100 * flops / mm_flops:.0f}% of the measured bf16 "
              f"matmul rate ({mm_flops / 1e12:.0f} TFLOP/s)")
    return rows


def transformers_rows(contexts: list[int], reps: int, bw: float) -> list[dict]:
    """HF Qwen3_5ForCausalLM on the same config, random bf16 weights, DynamicCache; one decode step after a
    prompt of `context` tokens, timed per step over `reps` steps."""
    import transformers

    from engine.models.presets import QWEN36_27B

    cfg = transformers.Qwen3_5TextConfig(**{k: v for k, v in QWEN36_27B.items() if k != "model_type"})
    # built in bf16: an fp32 build first (the class's constructor) needs twice the weights' memory, more than an H100
    with torch.device("cuda"):
        model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).eval()
    nbytes = sum(p.numel() * p.element_size() for p in model.parameters())
    rows = []
    for context in contexts:
        ids = torch.randint(0, cfg.vocab_size, (1, context), device="cuda")
        with torch.inference_mode():
            cache = transformers.DynamicCache(config=cfg)
            out = model(ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
            tok = out.logits[:, -1:].argmax(-1)
            times = []
            for _ in range(reps):
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                out = model(tok, past_key_values=out.past_key_values, use_cache=True)
                b.record()
                b.synchronize()
                times.append(a.elapsed_time(b))
                tok = out.logits[:, -1:].argmax(-1)
        ms = sorted(times)[len(times) // 2]
        kv = context * kv_bytes_per_token(preset_spec("qwen3.6-27b"), "bf16", 2)
        floor = (nbytes - cfg.vocab_size * cfg.hidden_size * 2 + kv) / bw * 1e3
        rows.append({"engine": "transformers", "gpu": gpu_name(), "model": "qwen3.6-27b config (random bf16)",
                     "weights": "bf16", "kv_dtype": "bf16", "context": context, "batch": 1, "T": 1,
                     "ms_per_step": ms, "floor_ms": floor, "ratio_to_floor": ms / floor, "tok_s": 1e3 / ms,
                     "peak_mem_gib": torch.cuda.max_memory_allocated() / 2**30,
                     "transformers": transformers.__version__})
        print_row(rows[-1])
    del model
    gc.collect()
    torch.cuda.empty_cache()
    return rows


def print_row(r: dict) -> None:
    print(f"{r['engine'][:12]:12s} {r['weights']:9s} kv {r['kv_dtype']:5s} ctx {r['context']:6d} "
          f"B={r['batch']} T={r['T']}  "
          f"{r['ms_per_step']:8.2f} ms  floor {r['floor_ms']:6.2f} ms  x{r['ratio_to_floor']:5.1f}  "
          f"{r['tok_s']:6.1f} tok/s  peak {r['peak_mem_gib']:.1f} GiB")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="synthetic:qwen3.6-27b")
    p.add_argument("--reps", type=int, default=50)
    p.add_argument("--quick", action="store_true", help="8K only, bf16 + int8 KV")
    p.add_argument("--no-baseline", action="store_true")
    p.add_argument("--eager", action="store_true", help="time the eager path instead of the CUDA graphs")
    p.add_argument("--weights", choices=[*MIXES, "all"], nargs="+", default=["all"], help="weight formats to run")
    p.add_argument("--prefill-chunks", type=int, nargs="+", default=[2048],
                   help="8K prefill in pieces of each size (2048: the 8k-speed profile's prefill_chunk)")
    p.add_argument("--prefill-only", action="store_true", help="only the 8K prefill rows (and the baseline)")
    args = p.parse_args()
    bw = copy_bandwidth()
    print(f"{gpu_name()}: device copy {bw / 1e9:.0f} GB/s")
    contexts = [8192] if args.quick else [8192, 65536]
    kvs = ["bf16", "int8"] if args.quick else ["bf16", "int8", "fp8"]
    rows = [{"gpu": gpu_name(), "copy_bw_gbs": bw / 1e9, "phase": "bandwidth"}]
    for weights in (MIXES if "all" in args.weights else args.weights):
        rows += engine_rows(args.model, [] if args.prefill_only else contexts, kvs, [1, 8], args.reps, bw, weights,
                            not args.eager, args.prefill_chunks)
    print("wrote", write_results("bench_decode", rows))  # kept should the baseline fail
    if not args.no_baseline:
        rows += transformers_rows([8192], args.reps, bw)
        print("wrote", write_results("bench_decode", rows))


if __name__ == "__main__":
    main()
