"""Triton kernels, each beside the plain-torch reference it is tested against."""
from __future__ import annotations

import os

import torch


def runs_here(t: torch.Tensor | torch.device) -> bool:
    """Whether Triton kernels serve tensors on this device (or t's): a GPU, or the CPU under the Triton
    interpreter when a kernel test asks for it (TRITON_INTERPRET=1 and NINFER_TRITON_ON_CPU=1)."""
    if (t if isinstance(t, torch.device) else t.device).type == "cuda":
        return True
    return os.environ.get("TRITON_INTERPRET") == "1" and os.environ.get("NINFER_TRITON_ON_CPU") == "1"
