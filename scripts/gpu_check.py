"""GPU check of the reference path (run once per GPU kind): bf16 logits vs the fp32 CPU oracle (transformers) on
tiny synthetic Qwen3.5 models, greedy agreement with bf16 KV, and the reference decode step of the 27B shape.

Usage: python scripts/gpu_check.py [--skip-27b]   -> table + scripts/results/gpu_check_<gpu>.json (or $OUT)
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from engine import Engine, EngineConfig, SamplingParams  # noqa: E402
from tests.conftest import hf_greedy, write_tiny  # noqa: E402
from tests.test_qwen35_oracle import CONFIGS  # noqa: E402


def rel(a, b) -> float:
    a, b = a.double().cpu(), b.double().cpu()
    return ((a - b).norm() / b.norm()).item()


def tiny_rows(tmp: Path) -> list[dict]:
    from transformers import AutoModelForCausalLM

    rows = []
    for name, overrides in CONFIGS.items():
        folder = write_tiny(tmp / name, seed=len(name), **overrides)
        ref = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
        ids = torch.randint(0, 256, (300,), generator=torch.Generator().manual_seed(0))
        with torch.inference_mode():
            expected = ref(ids[None]).logits[0]
        for dtype in ("float32", "bfloat16"):
            eng = Engine(EngineConfig(model=str(folder), device="cuda", dtype=dtype, kv_dtype="auto"))
            cache = eng.model.new_cache(300)
            with torch.inference_mode():
                got = eng.model.forward(ids.cuda(), cache, all_logits=True)
            greedy = eng.complete(ids[:40].tolist(), SamplingParams(max_tokens=64, temperature=0, ignore_eos=True))
            oracle = hf_greedy(ref, ids[:40].tolist(), 64)
            agree = next((i for i, (a, b) in enumerate(zip(greedy.token_ids, oracle, strict=True)) if a != b), 64)
            rows.append({"config": name, "dtype": dtype, "logits_rel_err": rel(got, expected),
                         "greedy_agree_tokens": agree})
    return rows


def big_row() -> dict:
    eng = Engine(EngineConfig(model="synthetic:qwen3.6-27b", device="cuda", dtype="bfloat16", kv_dtype="bf16",
                              max_context=9000))
    model = eng.model
    cache = model.new_cache(8192 + 64)
    ids = torch.randint(0, 248000, (8192,), device="cuda")
    with torch.inference_mode():
        torch.cuda.synchronize()
        t = time.perf_counter()
        for i in range(0, 8192, 1024):
            model.forward(ids[i:i + 1024], cache)
        torch.cuda.synchronize()
        prefill = time.perf_counter() - t
        tok = ids[:1]
        times = []
        for _ in range(20):
            torch.cuda.synchronize()
            t = time.perf_counter()
            model.forward(tok, cache)
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t)
    times.sort()
    return {"model": "synthetic:qwen3.6-27b", "engine": "ninfer-reference (eager torch)", "dtype": "bfloat16",
            "context": 8192, "prefill_8k_s": prefill, "prefill_tok_s": 8192 / prefill,
            "decode_step_ms_median": times[len(times) // 2] * 1e3, "peak_mem_gib": torch.cuda.max_memory_allocated()
            / 2**30}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--skip-27b", action="store_true")
    args = ap.parse_args()
    gpu = torch.cuda.get_device_name(0)
    with tempfile.TemporaryDirectory() as tmp:
        rows = tiny_rows(Path(tmp))
    result = {"gpu": gpu, "torch": torch.__version__, "tiny": rows}
    print(f"{'config':24s} {'dtype':9s} {'logits rel err':>14s} {'greedy agree/64':>15s}")
    for r in rows:
        print(f"{r['config']:24s} {r['dtype']:9s} {r['logits_rel_err']:14.2e} {r['greedy_agree_tokens']:>15d}")
    if not args.skip_27b:
        result["qwen3.6-27b"] = big_row()
        print(json.dumps(result["qwen3.6-27b"], indent=1))
    out = Path(os.environ.get("OUT", ROOT / "scripts" / "results"))
    out.mkdir(parents=True, exist_ok=True)
    (out / f"gpu_check_{gpu.replace(' ', '_')}.json").write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
