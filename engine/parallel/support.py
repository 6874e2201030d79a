"""What an engine over several ranks runs with (and the one-line refusals of what it does not run with yet)."""
from __future__ import annotations

import torch

from ..config import EngineConfig
from ..errors import UserError
from ..models.spec import ModelSpec
from .shards import check_split


def check_tensor_parallel(config: EngineConfig, geometry: ModelSpec, device: torch.device) -> None:
    """Refuse a tensor_parallel the machine, the model or the other settings cannot run, before anything starts."""
    n = config.tensor_parallel
    if n == 1:
        return
    if device.type == "cuda" and torch.cuda.device_count() < n:
        raise UserError(f"tensor_parallel = {n} needs {n} GPUs, {torch.cuda.device_count()} are visible",
                        hint="lower tensor_parallel, or make more GPUs visible (CUDA_VISIBLE_DEVICES)")
    check_settings(config, geometry, device.type)


def check_settings(config: EngineConfig, geometry: ModelSpec, device_type: str) -> None:
    """The refusals that depend on the settings and the model alone (what `profiles fit` checks too)."""
    n = config.tensor_parallel
    not_yet = (
        # NCCL, device placement and CUDA graphs with collectives inside have not run on a machine with two GPUs
        (device_type == "cuda", "GPUs", 'device = "cpu"'),
    )
    for refused, what, fix in not_yet:
        if refused:
            raise UserError(f"tensor_parallel = {n} does not run with {what} yet",
                            hint=f"use {fix}, or tensor_parallel = 1")
    check_split(geometry, n, config.weights.as_dict(), config.model)
