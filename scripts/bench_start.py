"""Start-up time to the first token. `ninfer generate` from a cold start (`cold-start`: Triton's kernel cache, the
kernel tiles file, CUDA's JIT cache and ninfer's own dirs empty, all in a temporary folder) and from a warm one
(`warm-start`: the caches the cold run left), each from the process's start to its first streamed token; then in
one process (warm caches), after the load, a first prompt and a second, different one (`first-prompt`,
`second-prompt`: the first's kernels must be ready at load, so its time to first token is the second's). Each
prompt is --context random token ids, a different one each time (none continues a held conversation). The user's
own dirs are never read or written (pulled models are read where they are).

Usage: python scripts/bench_start.py [--context 2048] [--timeout 300] -- NINFER_FLAGS...
  e.g. -- -P 8k-speed --model synthetic:qwen3.6-27b --spec none
  (the 8k-speed profile's settings on the synthetic 27B: q5/q4 weights, int8 KV, CUDA graphs; no drafter)
  CPU smoke: --context 64 -- --model synthetic:tiny --device cpu
  -> table + rows (`scenario`, `ttft_s`) in scripts/results/bench_long_<gpu>.json (or $OUT/; `cpu` on the CPU),
  replacing that file's rows of these scenarios and keeping the others (bench_long.py's)
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import random
import re
import site
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench_util import write_results  # noqa: E402

# Every dir a start reads or fills, moved into the run's folder: ninfer's own (profiles and settings, the kernel
# tiles file and compiled CPU kernels, held conversations), Triton's compiled kernels (with fla-core's autotune
# results), CUDA's JIT cache, and the home dir's (whatever else keeps a cache there).
ISOLATED = ("HOME", "XDG_CACHE_HOME", "XDG_CONFIG_HOME", "XDG_DATA_HOME", "XDG_STATE_HOME", "NINFER_CONFIG_DIR",
            "NINFER_DATA_DIR", "NINFER_STATE_DIR", "NINFER_CACHE_DIR", "TRITON_HOME", "TRITON_CACHE_DIR",
            "CUDA_CACHE_PATH")
PREFILL = re.compile(r"prefill ([\d.]+) tok/s")


@dataclasses.dataclass
class Start:
    ttft_s: float  # from the process's start to its first streamed token
    wall_s: float  # to its exit
    prefill_tok_s: float | None  # the prompt's own prefill, as `ninfer generate` reports it


def isolated_env(folder: Path) -> dict[str, str]:
    """This environment with every dir in ISOLATED under `folder`; pulled models and the user's site-packages
    (found through the real home) stay where they are."""
    import platformdirs

    env = dict(os.environ)
    models = env.get("NINFER_MODELS_DIR") or str(
        Path(env.get("NINFER_CACHE_DIR") or platformdirs.user_cache_dir("ninfer")) / "models")
    env.update({name: str(folder / name.lower()) for name in ISOLATED})
    env["PYTHONUSERBASE"] = site.getuserbase()
    env["NINFER_MODELS_DIR"] = models if Path(models).is_dir() else str(folder / "models")
    return env


def prompt(context: int, seed: int) -> list[int]:
    """`context` random byte-token ids (every vocabulary has them), starting with `seed`: prompts of different
    seeds share no prefix."""
    rng = random.Random(seed)
    return [seed] + [rng.randrange(256) for _ in range(context - 1)]


def run(cmd: list[str], env: dict[str, str], log: Path, timeout: float) -> tuple[float | None, float, str]:
    """Run `cmd` (stderr to `log`): when its first stdout byte came (None: it printed nothing) and when it exited,
    in seconds from its start, and its stdout. Killed after `timeout` seconds."""
    t0 = time.perf_counter()
    with open(log, "w") as err:
        p = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=err)
        killer = threading.Timer(timeout, p.kill)
        killer.start()
        try:
            first = p.stdout.read(1)
            first_s = time.perf_counter() - t0 if first else None
            out = first + p.stdout.read()
            p.wait()
        finally:
            killer.cancel()
    wall_s = time.perf_counter() - t0
    if p.returncode:
        if wall_s >= timeout:
            raise SystemExit(f"the {log.stem} run took over {timeout:.0f} s and was stopped: raise --timeout")
        lines = log.read_text().strip().splitlines()
        said = [line for line in lines if line.startswith(("error:", "hint:"))] or lines[-1:]
        raise SystemExit(f"the {log.stem} run failed (exit {p.returncode}): {'; '.join(said)}")
    return first_s, wall_s, out.decode(errors="replace")


def generate(flags: list[str], ids: list[int], env: dict[str, str], log: Path, timeout: float) -> Start:
    """`ninfer generate` of `ids`, one token, streamed: the first byte of its stdout is the token's text (or the
    line's end after a token with none, right after it)."""
    cmd = [sys.executable, "-m", "ninfer_tui.cli", "generate", "--prompt-ids", ",".join(map(str, ids)),
           "--max-tokens", "1", *flags]
    first_s, wall_s, _ = run(cmd, env, log, timeout)
    if first_s is None:
        raise SystemExit("ninfer generate printed no token: pass no --json among its flags")
    found = PREFILL.findall(log.read_text())
    return Start(first_s, wall_s, float(found[-1]) if found else None)


def in_process(flags: list[str], context: int) -> dict:
    """In this process: the engine as `ninfer generate` loads it from these flags, then the time to first token of
    a first prompt and of a second, different one, from their submission."""
    import torch

    from engine import TokenEvent
    from ninfer_tui.cli import build_parser
    from ninfer_tui.launch import engine_from_profile, profile_from_args, sampling_from_args

    args = build_parser().parse_args(["generate", "--prompt-ids", "0", *flags])
    profile = profile_from_args(args, announce=False)
    params = dataclasses.replace(sampling_from_args(args, profile), max_tokens=1)
    t0 = time.perf_counter()
    engine = engine_from_profile(profile, announce=False)
    load_s = time.perf_counter() - t0
    ttfts = []
    for seed in (2, 3):  # each to its end before the next: the second starts on an idle engine, as the first did
        t0, first = time.perf_counter(), None
        for event in engine.submit(prompt(context, seed), params):
            if first is None and isinstance(event, TokenEvent):
                first = time.perf_counter() - t0
        ttfts.append(first)
    gpu = torch.cuda.get_device_name(engine.device) if engine.device.type == "cuda" else None
    return {"gpu": gpu, "device": engine.device.type, "model": engine.model_name, "profile": profile.name,
            "kv_dtype": engine.config.kv_dtype, "load_s": load_s, "first_s": ttfts[0], "second_s": ttfts[1]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                 allow_abbrev=False)
    ap.add_argument("--context", type=int, default=2048, help="tokens of each prompt")
    ap.add_argument("--timeout", type=float, default=300, help="seconds each of the three processes may take")
    ap.add_argument("--in-process", action="store_true",
                    help="only the first and second prompt, in this process and its environment, as JSON (what the "
                    "full run starts in its temporary folder)")
    ap.add_argument("flags", nargs=argparse.REMAINDER, help="after --: flags of `ninfer generate` (profile, model, "
                    "device, formats)")
    args = ap.parse_args()
    flags = args.flags[1:] if args.flags[:1] == ["--"] else args.flags
    if args.context < 2:
        ap.error("--context must be at least 2 tokens")
    if args.in_process:
        print(json.dumps(in_process(flags, args.context)))
        return
    with tempfile.TemporaryDirectory(prefix="ninfer-bench-start-") as tmp:
        folder = Path(tmp)
        env = isolated_env(folder)
        starts = {}
        for seed, scenario in enumerate(("cold-start", "warm-start")):  # each line as it comes: a long cold start
            s = starts[scenario] = generate(flags, prompt(args.context, seed), env, folder / f"{scenario}.log",
                                            args.timeout)
            show(scenario, s.ttft_s, f"process exit {s.wall_s:.3f} s, prefill {s.prefill_tok_s} tok/s")
        cmd = [sys.executable, str(Path(__file__).resolve()), "--in-process", "--context", str(args.context), "--",
               *flags]
        info = json.loads(run(cmd, env, folder / "in-process.log", args.timeout)[2].strip().splitlines()[-1])
    ratio = info["first_s"] / info["second_s"]
    show("first-prompt", info["first_s"], f"after a load of {info['load_s']:.3f} s")
    show("second-prompt", info["second_s"], f"first / second = {ratio:.2f}")
    same = {"gpu": info["gpu"], "model": info["model"], "profile": info["profile"], "kv_dtype": info["kv_dtype"],
            "context": args.context, "flags": " ".join(flags), "date": time.strftime("%Y-%m-%d")}
    rows = [{**same, "scenario": scenario, "ttft_s": round(s.ttft_s, 3), "wall_s": round(s.wall_s, 3),
             "prefill_tok_s": s.prefill_tok_s} for scenario, s in starts.items()]
    rows += [{**same, "scenario": "first-prompt", "ttft_s": round(info["first_s"], 4),
              "load_s": round(info["load_s"], 3)},
             {**same, "scenario": "second-prompt", "ttft_s": round(info["second_s"], 4),
              "first_over_second": round(ratio, 3)}]
    print(f"{info['model']} ({info['profile']}, {info['kv_dtype']} KV) on {info['gpu'] or 'cpu'}, prompts of "
          f"{args.context} tokens")
    print("wrote", write_results("bench_long", rows, tag=info["gpu"] or "cpu", merge_key="scenario"))


def show(scenario: str, ttft_s: float, note: str) -> None:
    print(f"{scenario:14} ttft {ttft_s:9.3f} s  ({note})", flush=True)


if __name__ == "__main__":
    main()
