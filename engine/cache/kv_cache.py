"""KV cache for the full-attention layers of one sequence: bf16, or int8 / fp8 (e4m3) with per-(token, head) scales."""
from __future__ import annotations

import copy

import torch

from ..kernels import kvwrite
from ..transfer import to_host

# Largest magnitude each 8-bit format stores; a per-(token, head) scale maps the head's absmax onto it.
_QMAX = {"int8": 127.0, "fp8": 448.0}
_STORE = {"bf16": torch.bfloat16, "int8": torch.int8, "fp8": torch.float8_e4m3fn}


class KVCache:
    def __init__(self, num_layers: int, max_len: int, num_kv_heads: int, head_dim: int, kv_dtype: str,
                 compute_dtype: torch.dtype, device: torch.device) -> None:
        self.kv_dtype = kv_dtype
        self.compute_dtype = compute_dtype
        self.max_len = max_len
        store = compute_dtype if kv_dtype == "auto" else _STORE[kv_dtype]
        shape = (num_layers, max_len, num_kv_heads, head_dim)
        self.k = torch.empty(shape, dtype=store, device=device)
        self.v = torch.empty(shape, dtype=store, device=device)
        self.quantized = kv_dtype in _QMAX
        if self.quantized:
            self.k_scale = torch.empty(shape[:3], dtype=torch.float32, device=device)
            self.v_scale = torch.empty(shape[:3], dtype=torch.float32, device=device)

    def grow(self, max_len: int) -> None:
        """Make room for `max_len` tokens, keeping what is stored (a reused sequence that goes on longer)."""
        if max_len <= self.max_len:
            return
        for name in self._tensors():
            old = getattr(self, name)
            new = old.new_empty((old.shape[0], max_len, *old.shape[2:]))
            new[:, : self.max_len] = old
            setattr(self, name, new)
        self.max_len = max_len

    def write(self, layer: int, positions: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store k, v [T, H, D] at `positions` (a device tensor: a captured CUDA graph replays this at whatever
        positions the buffer holds then)."""
        if not self.quantized:
            self.k[layer].index_copy_(0, positions, k.to(self.k.dtype))
            self.v[layer].index_copy_(0, positions, v.to(self.v.dtype))
            return
        if kvwrite.usable(k, self.kv_dtype):
            kvwrite.write_quantized(k, v, positions, self.k[layer], self.v[layer], self.k_scale[layer],
                                    self.v_scale[layer], self.kv_dtype)
            return
        for src, dst, scale in ((k, self.k, self.k_scale), (v, self.v, self.v_scale)):
            q, s = quantize_per_head(src, self.kv_dtype)
            if q.dtype == torch.float8_e4m3fn:  # index_copy_ has no fp8 kernel on the CPU; the bytes are the same
                dst, q = dst.view(torch.uint8), q.view(torch.uint8)
            dst[layer].index_copy_(0, positions, q)
            scale[layer].index_copy_(0, positions, s)

    def _tensors(self) -> tuple[str, ...]:
        return ("k", "v", "k_scale", "v_scale") if self.quantized else ("k", "v")

    def copy_from(self, other: KVCache, n: int) -> None:
        """Take the first n tokens of another cache of the same geometry and format."""
        for name in self._tensors():
            getattr(self, name)[:, :n] = getattr(other, name)[:, :n]

    def copy_prefix(self, n: int, host: bool = False) -> KVCache:
        """A new cache holding (and sized to) the first n tokens of this one; in host memory when `host`."""
        new = copy.copy(self)
        for name in self._tensors():
            part = getattr(self, name)[:, :n]
            setattr(new, name, to_host(part) if host else part.clone())
        new.max_len = n
        return new

    @property
    def nbytes(self) -> int:
        return sum(getattr(self, name).nbytes for name in self._tensors())

    def read(self, layer: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.quantized:
            return self.k[layer, :end].to(self.compute_dtype), self.v[layer, :end].to(self.compute_dtype)
        return (
            dequantize_per_head(self.k[layer, :end], self.k_scale[layer, :end], self.compute_dtype),
            dequantize_per_head(self.v[layer, :end], self.v_scale[layer, :end], self.compute_dtype),
        )


def quantize_per_head(x: torch.Tensor, kv_dtype: str) -> tuple[torch.Tensor, torch.Tensor]:
    """x: [T, H, D] -> (codes [T, H, D], scale [T, H]) with x ~= codes * scale."""
    xf = x.float()
    scale = xf.abs().amax(dim=-1).clamp_min(1e-12) / _QMAX[kv_dtype]
    scaled = xf / scale[..., None]
    if kv_dtype == "int8":  # halves round up (not to even): the fused write kernel rounds the same way
        return torch.floor(scaled + 0.5).clamp_(-127, 127).to(torch.int8), scale
    return scaled.to(torch.float8_e4m3fn), scale


def dequantize_per_head(codes: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return (codes.float() * scale[..., None]).to(dtype)
