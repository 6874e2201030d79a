"""CPU benchmark of the default model: prefill and decode tok/s of ninfer, and of llama.cpp (llama-cpp-python) on the
same GGUF in the same run, as a table and JSON under scripts/results/.

The runs alternate (ninfer, llama.cpp, ninfer, ...) so that both see the same machine: on a CPU shared with other
work the load drifts from minute to minute, and only figures from one run compare. Each run: a prompt of random
tokens, then greedy decoding without EOS; run 0 of each engine is a warm-up. llama.cpp is skipped (with a note in
the JSON) where llama_cpp does not import; scripts/check_gguf_oracle.sh says how to build it.

Usage: python scripts/bench_cpu.py [--model M] [--prompt-tokens 256] [--new 128] [--runs 3] [--threads N]
                                   [--dequantized]
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path

import torch

from engine import Engine, EngineConfig, SamplingParams
from ninfer_tui.models import resolve


def ninfer_run(engine: Engine, prompt: list[int], new: int) -> dict:
    t = time.perf_counter()
    final = engine.complete(prompt, SamplingParams(max_tokens=new, temperature=0, ignore_eos=True))
    return {"prefill_tok_s": final.timings.prefill_tok_s, "decode_tok_s": final.timings.decode_tok_s,
            "wall_s": time.perf_counter() - t}


def llama_cpp_run(llm, prompt: list[int], new: int) -> dict:
    """Prefill, then `new` greedy tokens one eval at a time (llama-cpp-python's own loop in `generate`)."""
    import numpy as np

    llm.reset()
    t0 = time.perf_counter()
    llm.eval(prompt)
    t1 = time.perf_counter()
    token = int(np.argmax(llm.scores[llm.n_tokens - 1]))
    for _ in range(new - 1):
        llm.eval([token])
        token = int(np.argmax(llm.scores[llm.n_tokens - 1]))
    t2 = time.perf_counter()
    return {"prefill_tok_s": len(prompt) / (t1 - t0), "decode_tok_s": (new - 1) / (t2 - t1), "wall_s": t2 - t0}


def summary(rows: list[dict]) -> dict:
    return {"runs": rows, "prefill_tok_s_median": statistics.median(r["prefill_tok_s"] for r in rows),
            "decode_tok_s_median": statistics.median(r["decode_tok_s"] for r in rows)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--prompt-tokens", type=int, default=256)
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--threads", type=int, default=os.cpu_count(), help="threads for both engines")
    ap.add_argument("--dequantized", action="store_true",
                    help="also ninfer with the GGUF dequantized to fp32 at load (no block matmuls: fp32 weights)")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "bench_cpu.json"))
    args = ap.parse_args()

    path = resolve(args.model, announce=False)
    engine = Engine(EngineConfig(model=path, device="cpu", threads=args.threads))
    engines_run = {"ninfer": engine}
    if args.dequantized:  # the file dequantized to fp32 at load, as before the CPU kernels read its blocks
        from engine.kernels import cpu_gguf

        available, cpu_gguf.available = cpu_gguf.available, lambda: False
        try:
            engines_run["ninfer (fp32 weights)"] = Engine(EngineConfig(model=path, device="cpu",
                                                                       threads=args.threads))
        finally:
            cpu_gguf.available = available
    try:
        import llama_cpp

        llm = llama_cpp.Llama(model_path=path, n_ctx=args.prompt_tokens + args.new + 8, n_batch=512,
                              n_threads=args.threads, n_threads_batch=args.threads, logits_all=False, verbose=False)
        note = f"llama-cpp-python {llama_cpp.__version__}"
    except ImportError:
        llm, note = None, "llama_cpp not installed: no llama.cpp rows (scripts/check_gguf_oracle.sh builds it)"
    g = torch.Generator().manual_seed(0)
    rows: dict[str, list[dict]] = {name: [] for name in [*engines_run, "llama.cpp"]}
    for run in range(args.runs + 1):  # run 0 is the warm-up
        prompt = torch.randint(100, engine.geometry.vocab_size, (args.prompt_tokens,), generator=g).tolist()
        results = [(name, ninfer_run(e, prompt, args.new)) for name, e in engines_run.items()]
        if llm is not None:
            results.append(("llama.cpp", llama_cpp_run(llm, prompt, args.new)))
        if run:
            for name, r in results:
                rows[name].append({"run": run, **r})
    engines = {name: summary(r) for name, r in rows.items() if r}
    result = {
        "model": args.model, "gguf": Path(path).name, "device": "cpu",
        "cpu": platform.processor() or platform.machine(), "threads": args.threads, "cores": os.cpu_count(),
        "torch": torch.__version__, "llama_cpp": note, "prompt_tokens": args.prompt_tokens, "new_tokens": args.new,
        "engines": engines,
    }
    if "llama.cpp" in engines:
        result["decode_ratio_ninfer_to_llama_cpp"] = (engines["ninfer"]["decode_tok_s_median"]
                                                     / engines["llama.cpp"]["decode_tok_s_median"])
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(f"{'engine':>21} {'run':>4} {'prefill tok/s':>14} {'decode tok/s':>13} {'wall s':>8}")
    for name, r in rows.items():
        for row in r:
            print(f"{name:>21} {row['run']:>4} {row['prefill_tok_s']:>14.1f} {row['decode_tok_s']:>13.1f} "
                  f"{row['wall_s']:>8.2f}")
    for name, s in engines.items():
        print(f"{name:>21} median: prefill {s['prefill_tok_s_median']:.1f} tok/s, "
              f"decode {s['decode_tok_s_median']:.1f} tok/s")
    if "decode_ratio_ninfer_to_llama_cpp" in result:
        print(f"decode ninfer / llama.cpp: {result['decode_ratio_ninfer_to_llama_cpp']:.2f}x ({args.threads} threads)")
    print(f"-> {args.out}")


if __name__ == "__main__":
    main()
