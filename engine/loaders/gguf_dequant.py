"""GGUF tensors to float32 arrays.

The legacy blocks most small GGUF files use (Q4_0, Q4_1, Q8_0) are decoded into one output buffer that is then
scaled in place: three passes over memory where the `gguf` package's general code makes a dozen temporaries of
the whole tensor, which made it most of a small model's load. numpy, not torch: a call is one thread (the loader
decodes several tensors at once), which a busy machine slows down less than a team of threads that waits for its
slowest member at every op. The other types go through the `gguf` package. Both give the same float32 values:
each element is the same product (and sum), rounded once per operation."""
from __future__ import annotations

import numpy as np
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize as gguf_dequantize

_BLOCK_BYTES = {Q.Q4_0: 18, Q.Q4_1: 20, Q.Q8_0: 34}


def _f16(cols: np.ndarray) -> np.ndarray:
    """Each block's little-endian fp16 fields (2 bytes each) as float32 columns."""
    return cols.copy().view(np.float16).astype(np.float32)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """16 bytes per block -> 32 float codes in ggml's order: the low halves are elements 0-15, the high 16-31."""
    out = np.empty((qs.shape[0], 32), dtype=np.float32)
    np.bitwise_and(qs, 0x0F, out=out[:, :16], casting="unsafe")
    np.right_shift(qs, 4, out=out[:, 16:], casting="unsafe")
    return out


def dequantize(raw: np.ndarray, qtype: int, shape: tuple[int, ...]) -> np.ndarray:
    """A tensor's stored bytes (uint8) -> a new float32 array of `shape`."""
    if qtype in _BLOCK_BYTES:
        blocks = raw.reshape(-1, _BLOCK_BYTES[qtype])
        scale = _f16(blocks[:, :2])
        if qtype == Q.Q8_0:
            out = blocks[:, 2:].view(np.int8).astype(np.float32)
            out *= scale
        elif qtype == Q.Q4_0:
            out = _nibbles(blocks[:, 2:])
            out -= 8
            out *= scale
        else:
            out = _nibbles(blocks[:, 4:])
            out *= scale
            out += _f16(blocks[:, 2:4])
    elif qtype == Q.F32:
        out = raw.view(np.float32).copy()
    else:
        rows = raw.reshape(int(np.prod(shape[:-1])), -1)
        out = np.ascontiguousarray(gguf_dequantize(rows, Q(qtype)), dtype=np.float32)
    return out.reshape(shape)
