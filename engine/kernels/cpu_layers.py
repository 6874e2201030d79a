"""The per-token ops of a CPU step in C (`cpu_layers.c`): residual add + RMSNorm, RoPE, causal attention over a
sequence's cached keys, SiLU-and-multiply. Each replaces several torch ops whose dispatch, not arithmetic, is what
a small model's decode step spends; the references are the torch paths in `models/layers.py`. fp32 CPU tensors
only (`usable`); a machine without a C compiler keeps the torch paths."""
from __future__ import annotations

import ctypes

import torch

from . import cpu_build

MAX_ATTENTION_ROWS = 16  # decode and verify steps; a prefill chunk takes torch's flash attention
_I64, _PTR, _INT, _F32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int, ctypes.c_float
_SIGNATURES = {
    "ninfer_add_rms_norm": ([_PTR, _PTR, _PTR, _I64, _I64, _F32, _INT, _PTR, _PTR], None),
    "ninfer_rope": ([_PTR, _I64, _I64, _I64, _I64, _I64, _PTR, _PTR, _PTR], None),
    "ninfer_attention": ([_PTR, _I64, _I64, _I64, _PTR, _PTR, _I64, _I64, _F32, _PTR, _INT], _INT),
    "ninfer_silu_mul": ([_PTR, _I64, _I64, _PTR], None),
}
_state: dict[str, ctypes.CDLL | None] = {}


def _library() -> ctypes.CDLL | None:
    if "lib" not in _state:
        try:
            _state["lib"] = cpu_build.library(_SIGNATURES)
        except OSError:
            _state["lib"] = None
    return _state["lib"]


def usable(*tensors: torch.Tensor) -> bool:
    """fp32 CPU tensors, and the kernels built."""
    for t in tensors:
        if t.dtype != torch.float32 or t.is_cuda:
            return False
    return _library() is not None


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float,
                 zero_centred: bool) -> tuple[torch.Tensor, torch.Tensor]:
    x = x.contiguous()
    d = x.shape[-1]
    total, normed = torch.empty_like(x), torch.empty_like(x)
    res = None if residual is None else residual.contiguous().data_ptr()
    _library().ninfer_add_rms_norm(x.data_ptr(), res, weight.contiguous().data_ptr(), x.numel() // d, d, eps,
                                   zero_centred, total.data_ptr(), normed.data_ptr())
    return total, normed


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rotary_dim: int) -> torch.Tensor:
    """x [T, H, D], each head's D values contiguous (rows may be a fused projection's: any stride between them)."""
    t, h, d = x.shape
    if x.stride(2) != 1 or x.stride(1) != d:
        x = x.contiguous()
    out = torch.empty(t, h, d)
    _library().ninfer_rope(x.data_ptr(), t, x.stride(0), h, d, rotary_dim, cos.contiguous().data_ptr(),
                           sin.contiguous().data_ptr(), out.data_ptr())
    return out


def attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, start: int, scale: float) -> torch.Tensor:
    """q [T, H, D] at positions start..start+T-1 over keys, values [start+T, Hkv, D]: [T, H, D]."""
    t, h, d = q.shape
    q, keys, values = q.contiguous(), keys.contiguous(), values.contiguous()
    out = torch.empty(t, h, d)
    if _library().ninfer_attention(q.data_ptr(), t, h, d, keys.data_ptr(), values.data_ptr(), keys.shape[1], start,
                                   scale, out.data_ptr(), torch.get_num_threads()):
        raise MemoryError("out of memory for the attention scores")
    return out


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    gate_up = gate_up.contiguous()
    f = gate_up.shape[-1] // 2
    out = torch.empty(*gate_up.shape[:-1], f)
    _library().ninfer_silu_mul(gate_up.data_ptr(), gate_up.numel() // (2 * f), f, out.data_ptr())
    return out
