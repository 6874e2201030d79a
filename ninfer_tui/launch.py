"""From parsed CLI flags to a profile, a loaded Engine and SamplingParams (the one place front ends build them)."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from engine import SamplingParams
from engine.config import DEVICES, KV_DTYPES, SPEC_METHODS, WEIGHT_FORMATS, setting_help
from engine.errors import UserError

from . import profiles
from .models import resolve
from .profiles import Profile

if TYPE_CHECKING:
    from engine import Engine

# CLI flags (argparse dest = profile key) that override the profile: the engine flags every engine command takes,
# and the server's address (serve only; absent elsewhere).
PROFILE_FLAGS = ("model", "device", "weights", "threads", "max_context", "kv_capacity", "kv_dtype", "prefill_chunk",
                 "max_concurrency", "max_pending_requests", "tensor_parallel", "spec", "draft_tokens", "drafter",
                 "mmproj", "host", "port")


def _setting(p: argparse.ArgumentParser, name: str, *aliases: str, **kwargs) -> None:
    """A flag for an engine setting; its help is the setting's own (engine/config.py)."""
    p.add_argument("--" + name.replace("_", "-"), *aliases, help=setting_help(name), **kwargs)


def add_engine_args(p: argparse.ArgumentParser, model: bool = True) -> None:
    """The engine flags; `model=False` where the model is a positional argument (`ninfer run MODEL`)."""
    p.add_argument("--profile", "-P", help="launch profile (default: the one set by `ninfer profiles use`)")
    if model:
        _setting(p, "model", "-m", metavar="MODEL")
    _setting(p, "device", choices=DEVICES)
    _setting(p, "threads", type=int, metavar="N")
    _setting(p, "weights", choices=WEIGHT_FORMATS)
    _setting(p, "max_context", type=int, metavar="TOKENS")
    _setting(p, "kv_capacity", type=int, metavar="TOKENS")
    _setting(p, "kv_dtype", choices=KV_DTYPES)
    _setting(p, "prefill_chunk", type=int, metavar="TOKENS")
    _setting(p, "max_concurrency", type=int, metavar="N")
    _setting(p, "max_pending_requests", type=int, metavar="N")
    _setting(p, "tensor_parallel", type=int, metavar="N")
    _setting(p, "spec", choices=SPEC_METHODS)
    _setting(p, "draft_tokens", type=int, metavar="N")
    _setting(p, "drafter", metavar="PATH")
    _setting(p, "mmproj", metavar="FILE")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override any profile key (repeatable), e.g. --set cuda_graphs=false")


def add_sampling_args(p: argparse.ArgumentParser) -> None:
    """Per-request sampling; unset flags take the profile's [sampling] defaults."""
    p.add_argument("--max-tokens", "-n", type=int, metavar="N", help="most tokens to generate for a reply")
    p.add_argument("--temperature", "-t", type=float, metavar="T",
                   help="randomness of sampling; 0 = always the likeliest token")
    p.add_argument("--top-p", type=float, metavar="P",
                   help="sample from the smallest set of tokens whose probabilities add up to P (1 = off)")
    p.add_argument("--top-k", type=int, metavar="K", help="sample from the K likeliest tokens only (0 = off)")
    p.add_argument("--min-p", type=float, metavar="P",
                   help="drop tokens less likely than P times the likeliest one (0 = off)")
    p.add_argument("--repeat-penalty", type=float, metavar="X",
                   help="make tokens already in the context X times less likely (1 = off; above 1 discourages loops)")
    p.add_argument("--seed", type=int, default=None, metavar="N", help="seed for sampling, for reproducible replies")
    p.add_argument("--stop", action="append", default=[], metavar="TEXT", help="stop string (repeatable)")


def profile_from_args(args: argparse.Namespace, announce: bool = True) -> Profile:
    overrides = profiles.parse_set(args.set)
    for flag in PROFILE_FLAGS:
        value = getattr(args, flag, None)
        if value is not None:
            overrides[flag] = value
    note = (lambda msg: print(msg, file=sys.stderr)) if announce else None
    profile = profiles.select(args.profile, overrides, announce=note)
    check_device(profile)
    return profile


def check_device(profile: Profile) -> None:
    """A CUDA device that is not there fails here, before a model is pulled or loaded."""
    if profile.device == "cuda" and not profiles.cuda_available():
        raise UserError(f"device 'cuda' was asked for (profile {profile.name} or --device) but no CUDA GPU is "
                        "visible", hint="use --device cpu, or --device auto to take a GPU when there is one")


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
    import torch

    from engine import Engine
    from engine.engine import resolve_device

    model = resolve(profile.model, announce=announce)
    config = profile.engine_config(model)
    if announce:
        device = resolve_device(config.device).type
        n = config.threads or torch.get_num_threads()
        threads = f", {n} CPU thread{'s' if n > 1 else ''}" if device == "cpu" else ""
        print(f"loading {model} (profile {profile.name}{threads})", file=sys.stderr)
        if device == "cuda" and not Path(config.kernel_cache).exists():
            print("first launch with this cache: the kernels' tiles are timed for this GPU before the CUDA "
                  "graphs are captured (a few minutes, once; later launches read them back)", file=sys.stderr)
    return Engine(config, on_capture=capture_progress if announce else None)


def capture_progress(done: int, total: int) -> None:
    """A one-line progress bar of the GPU's load steps: CUDA-graph captures, then the prefill kernels' warm-up."""
    bar = "#" * done + "-" * (total - done)
    end = "\n" if done == total else ""
    print(f"\rcapturing CUDA graphs, compiling prefill kernels [{bar}] {done}/{total}", end=end, file=sys.stderr,
          flush=True)
