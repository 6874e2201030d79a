"""`ninfer convert SRC OUT`: a HF folder or .gguf file written as a converted model folder in a profile's weight
formats (engine/convert.py), which `run`, `generate` and `serve` load without quantizing."""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from engine.config import WEIGHT_FORMATS, setting_help

from . import profiles
from .profiles import Profile


def add_parser(sub) -> None:
    p = sub.add_parser("convert", help="write a HF folder or .gguf file as a ninfer model folder in the profile's "
                       "weight formats, which loads without quantizing")
    p.add_argument("src", metavar="SRC", help="registry name, .gguf file or HF folder")
    p.add_argument("out", metavar="OUT", help="the folder to write (new, or empty; --force replaces a converted one)")
    p.add_argument("--profile", "-P", help="the profile whose weight formats and dtype the folder gets (default: "
                   "the one set by `ninfer profiles use`)")
    p.add_argument("--weights", choices=WEIGHT_FORMATS, help=setting_help("weights"))
    p.add_argument("--mmproj", metavar="FILE", help=setting_help("mmproj"))
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override a profile key (repeatable), e.g. --set weights.mlp=q4 or --set dtype=bfloat16")
    p.add_argument("--force", action="store_true", help="replace OUT if it is a converted model folder")


def compute_dtype(profile: Profile):
    """The dtype the profile's engine computes in, where it would run (no GPU needed to convert for one)."""
    import torch

    from engine.engine import resolve_dtype

    gpu = profile.device == "cuda" or (profile.device == "auto" and profiles.cuda_available())
    return resolve_dtype(profile.dtype, torch.device("cuda" if gpu else "cpu"))


def run(args: argparse.Namespace) -> int:
    overrides = profiles.parse_set(args.set)
    if args.weights is not None:
        overrides["weights"] = args.weights
    if args.mmproj is not None:
        overrides["mmproj"] = args.mmproj
    profile = profiles.select(args.profile, overrides, announce=lambda msg: print(msg, file=sys.stderr))
    import torch

    from engine.convert import convert

    from .models import resolve
    from .progress import size_text

    if profile.threads:
        torch.set_num_threads(profile.threads)
    src = resolve(args.src)
    dtype = compute_dtype(profile)
    formats = ", ".join(f"{k} {v}" for k, v in profile.weights.as_dict().items())
    print(f"converting {src} with profile {profile.name}: {formats}, {str(dtype).removeprefix('torch.')} compute",
          file=sys.stderr)
    start = time.perf_counter()
    done = convert(src, Path(args.out), profile.weights, dtype, args.force,
                   log=lambda msg: print(msg, file=sys.stderr), mmproj=profile.mmproj)
    print(f"wrote {len(done.manifest.shards)} shard(s), {size_text(done.bytes)}, in "
          f"{time.perf_counter() - start:.1f} s", file=sys.stderr)
    print(done.folder)
    return 0
