"""CPU matmul and row lookup on GGUF block-quantized weights (`quant/gguf_blocks.py`), in C (`cpu_gguf.c`, built by
`cpu_build.py`; a machine without a C compiler loads GGUF weights dequantized instead: `available()`).
Decode and verify steps (up to STEP_ROWS rows, MAX_ROWS a call) run the C dot products; prefill-sized inputs
dequantize each weight in C and multiply with torch. The reference is `x @ dequantize(w).T` (`linear_reference`)."""
from __future__ import annotations

import ctypes

import torch

from ..quant.gguf_blocks import GGUFWeight, dequantize
from . import cpu_build

MAX_ROWS = 16  # cpu_gguf.c's MAX_X_ROWS
# Up to this many rows (several requests' verify steps) the dot products run MAX_ROWS at a time: faster than
# dequantizing the weight for them, and each row's result is then the same whatever rows share its step, so a
# request's tokens do not depend on what runs beside it
STEP_ROWS = 4 * MAX_ROWS
_I64, _PTR, _INT = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int
_SIGNATURES = {
    "ninfer_gguf_linear": ([_INT, _PTR, _I64, _I64, _PTR, _I64, _PTR, _I64, _INT], _INT),
    "ninfer_gguf_dequantize": ([_INT, _PTR, _I64, _PTR, _I64, _PTR, _INT], None),
}


def library() -> ctypes.CDLL:
    return cpu_build.library(_SIGNATURES)


def available() -> bool:
    try:
        library()
    except OSError:
        return False
    return True


def linear_reference(x: torch.Tensor, w: GGUFWeight) -> torch.Tensor:
    return torch.nn.functional.linear(x, dequantize(w, x.dtype))


def linear(x: torch.Tensor, w: GGUFWeight) -> torch.Tensor:
    """x [..., K] @ W.T in fp32, returned in the weight's compute dtype. A decode step makes ~120 of these calls:
    each torch op spared here is a few microseconds of the step."""
    x = getattr(x, "x", x)  # int8 rows made for a GPU kernel (`QuantRows`) are not used here
    if x.dtype != torch.float32 or not x.is_contiguous():
        x = x.to(torch.float32).contiguous()
    rows = x.numel() // w.in_features
    lib, threads = library(), torch.get_num_threads()
    if rows > STEP_ROWS:  # prefill-sized: each part dequantized once, then one torch matmul over all rows
        x2 = x.reshape(rows, w.in_features)
        out = torch.cat([torch.nn.functional.linear(x2, _dequantize(lib, p, w.in_features, None, threads))
                         for p in w.parts], dim=-1).reshape(*x.shape[:-1], w.out_features)
    else:
        out = torch.empty(*x.shape[:-1], w.out_features)
        n, k = w.out_features, w.in_features
        for first in range(0, rows, MAX_ROWS):
            m = min(MAX_ROWS, rows - first)
            y, ptr = out.data_ptr() + 4 * n * first, x.data_ptr() + 4 * k * first
            for p in w.parts:
                if lib.ninfer_gguf_linear(p.qtype, p.data.data_ptr(), p.rows, k, ptr, m, y, n, threads):
                    raise MemoryError("out of memory for the activations of a CPU GGUF matmul")
                y += 4 * p.rows
    return out if w.compute_dtype == torch.float32 else out.to(w.compute_dtype)


def rows(w: GGUFWeight, ids: torch.Tensor) -> torch.Tensor:
    """The dequantized rows `ids` of w, in its compute dtype."""
    lib, threads = library(), torch.get_num_threads()
    ids = ids.reshape(-1).to(torch.int64).contiguous()
    if len(w.parts) == 1:
        out = _dequantize(lib, w.parts[0], w.in_features, ids, threads)
    else:
        out = torch.empty(len(ids), w.in_features)
        first = 0
        for p in w.parts:
            mine = (ids >= first) & (ids < first + p.rows)
            if bool(mine.any()):
                out[mine] = _dequantize(lib, p, w.in_features, (ids[mine] - first).contiguous(), threads)
            first += p.rows
    return out if w.compute_dtype == torch.float32 else out.to(w.compute_dtype)


def _dequantize(lib: ctypes.CDLL, part, k: int, ids: torch.Tensor | None, threads: int) -> torch.Tensor:
    n = part.rows if ids is None else len(ids)
    out = torch.empty(n, k, dtype=torch.float32)
    lib.ninfer_gguf_dequantize(part.qtype, part.data.data_ptr(), k, None if ids is None else ids.data_ptr(), n,
                               out.data_ptr(), threads)
    return out
