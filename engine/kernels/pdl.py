"""Programmatic dependent launch (PDL, sm_90 and newer): a step kernel launched with it may start while the kernel
before it in the stream is still running, and waits (`enter`) before it reads anything that kernel wrote; it then
lets the next kernel start. A decode step is ~600 small dependent launches, and without PDL each pays a launch and
a ramp-up after the one before has drained; with PDL the next kernel's programs are already resident when the
previous one ends, and a matmul requests its first weights before it waits (weights never depend on the previous
kernel): `int8_dp4a` loads its first tile, `int8_mma_groups` asks L2 for its first two, the tiled CUDA matmuls
load their first groups. CUDA graphs keep the dependency as a programmatic edge.

GPUs before sm_90 (the RTX 4090 is sm_89) have no PDL: there the flag is off, `enter` compiles to nothing and
the launch is an ordinary one. NINFER_PDL=0 turns it off everywhere (to compare, or to rule it out).

Every kernel launched with PDL must call `enter` in every program before its first read of data another kernel
wrote and before its first store: a program that waited is what keeps the kernels after it ordered behind the
kernels before it."""
from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

ENABLED = os.environ.get("NINFER_PDL", "1") != "0"


@functools.cache
def _supported(index: int) -> bool:
    return torch.cuda.get_device_capability(index) >= (9, 0)


def on(t: torch.Tensor | torch.device) -> bool:
    """Whether kernels on t's device launch with PDL (a CUDA device of sm_90 or newer, and not turned off)."""
    device = t if isinstance(t, torch.device) else t.device
    return ENABLED and device.type == "cuda" and _supported(device.index if device.index is not None
                                                             else torch.cuda.current_device())


def launch(t: torch.Tensor | torch.device) -> dict:
    """A PDL kernel's launch keywords: its `PDL` constexpr and Triton's `launch_pdl` option."""
    flag = on(t)
    return {"PDL": flag, "launch_pdl": flag}


@triton.jit
def enter(PDL: tl.constexpr):
    """Wait for the kernel before this one in the stream to finish (its writes visible), then let the kernel
    after this one start launching."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()
