"""From parsed CLI flags to a loaded Engine and SamplingParams (the one place front ends build them)."""
from __future__ import annotations

import argparse
import sys

from engine import Engine, EngineConfig, SamplingParams

from .models import resolve


def sampling_from_args(args: argparse.Namespace) -> SamplingParams:
    return SamplingParams(
        max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
        min_p=args.min_p, repetition_penalty=args.repeat_penalty, seed=args.seed, stop=tuple(args.stop),
    )


def engine_from_args(args: argparse.Namespace, announce: bool = True) -> Engine:
    model = resolve(args.model, announce=announce)
    config = EngineConfig(model=model, device=args.device, max_context=args.max_context, kv_dtype=args.kv_dtype,
                          prefill_chunk=args.prefill_chunk)
    if announce:
        print(f"loading {model}", file=sys.stderr)
    return Engine(config)
