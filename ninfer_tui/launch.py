"""From parsed CLI flags to a profile, a loaded Engine and SamplingParams (the one place front ends build them)."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from engine import Engine, SamplingParams
from engine.engine import resolve_device

from . import profiles
from .models import resolve
from .profiles import Profile

# CLI flags (argparse dest = profile key) that override the profile: the engine flags every engine command takes,
# and the server's address (serve only; absent elsewhere).
PROFILE_FLAGS = ("model", "device", "weights", "max_context", "kv_capacity", "kv_dtype", "prefill_chunk",
                 "max_concurrency", "max_pending_requests", "spec", "draft_tokens", "drafter", "host", "port")


def add_engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--profile", "-P", help="launch profile (default: the one set by `ninfer profiles use`)")
    p.add_argument("--model", "-m", help="registry name, .gguf file, HF folder or synthetic:PRESET")
    p.add_argument("--device", choices=["auto", "cpu", "cuda"])
    p.add_argument("--weights", help="weight format for every projection: auto, bf16, q8, q5, q4")
    p.add_argument("--max-context", type=int)
    p.add_argument("--kv-capacity", type=int)
    p.add_argument("--kv-dtype", choices=["auto", "bf16", "fp8", "int8"])
    p.add_argument("--prefill-chunk", type=int)
    p.add_argument("--max-concurrency", type=int)
    p.add_argument("--max-pending-requests", type=int)
    p.add_argument("--spec", choices=["none", "mtp", "dflash", "ngram"])
    p.add_argument("--draft-tokens", type=int, help="guesses verified per step with --spec (1..7)")
    p.add_argument("--drafter", help="DFlash drafter checkpoint folder (spec dflash), or synthetic:PRESET")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override any profile key (repeatable), e.g. --set cuda_graphs=false")


def add_sampling_args(p: argparse.ArgumentParser) -> None:
    """Per-request sampling; unset flags take the profile's [sampling] defaults."""
    p.add_argument("--max-tokens", "-n", type=int)
    p.add_argument("--temperature", "-t", type=float)
    p.add_argument("--top-p", type=float)
    p.add_argument("--top-k", type=int)
    p.add_argument("--min-p", type=float)
    p.add_argument("--repeat-penalty", type=float)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")


def profile_from_args(args: argparse.Namespace, announce: bool = True) -> Profile:
    overrides = profiles.parse_set(args.set)
    for flag in PROFILE_FLAGS:
        value = getattr(args, flag, None)
        if value is not None:
            overrides[flag] = value
    note = (lambda msg: print(msg, file=sys.stderr)) if announce else None
    return profiles.select(args.profile, overrides, announce=note)


def sampling_from_args(args: argparse.Namespace, profile: Profile) -> SamplingParams:
    """The profile's [sampling] with the flags given on top (an empty Namespace gives the profile's own)."""
    d = profile.sampling

    def pick(flag: str, default):
        value = getattr(args, flag, None)
        return default if value is None else value

    return SamplingParams(
        max_tokens=pick("max_tokens", d.max_tokens), temperature=pick("temperature", d.temperature),
        top_p=pick("top_p", d.top_p), top_k=pick("top_k", d.top_k), min_p=pick("min_p", d.min_p),
        repetition_penalty=pick("repeat_penalty", d.repeat_penalty), seed=getattr(args, "seed", None),
        stop=tuple(getattr(args, "stop", ())),
    )


def engine_from_profile(profile: Profile, announce: bool = True) -> Engine:
    model = resolve(profile.model, announce=announce)
    config = profile.engine_config(model)
    if announce:
        print(f"loading {model} (profile {profile.name})", file=sys.stderr)
        if resolve_device(config.device).type == "cuda" and not Path(config.kernel_cache).exists():
            print("first launch with this cache: the kernels' tiles are timed for this GPU before the CUDA "
                  "graphs are captured (a few minutes, once; later launches read them back)", file=sys.stderr)
    return Engine(config, on_capture=capture_progress if announce else None)


def capture_progress(done: int, total: int) -> None:
    """A one-line progress bar for CUDA-graph capture at load."""
    bar = "#" * done + "-" * (total - done)
    end = "\n" if done == total else ""
    print(f"\rcapturing CUDA graphs [{bar}] {done}/{total}", end=end, file=sys.stderr, flush=True)
