"""Group-wise symmetric integer weights (q8, q5, q4): quantize at load (round to nearest per group of 64 along
the input dimension, one bf16/fp16 scale per group), the plain-torch dequantize that is the reference, and the
matmul that picks the Triton kernel on a GPU.

Layout (rows are output features; every row's bytes are contiguous for 16-byte loads):
- q8: int8 codes [N, K].
- q4: uint8 [N, K/2], two codes per byte (low nibble = even k), stored as code + 8.
- q5: the q4 nibble plane [N, K/2] for the low 4 bits of code + 16, and a bit plane [N, K/8] for the 5th bit.
On a GPU that runs the tiled kernels (`kernels/qtiled.py`), q4/q5 weights are stored tiled instead (`tile`): 16
rows x one group per tile, in the order those kernels' lanes load them (described there). `untile` gives the
row-major layout back, which the reference, the embedding lookup and prefill-sized matmuls read.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from . import gguf_blocks
from .formats import FORMATS
from .packed import PackedWeight

GROUP = 64
_QMAX = {"q8": 127, "q5": 15, "q4": 7}


@dataclass
class QuantizedWeight(PackedWeight):
    fmt: str
    codes: torch.Tensor  # int8 [N, K] (q8) or uint8 nibbles [N, K/2] (q4, q5)
    scales: torch.Tensor  # [N, K/GROUP], bf16 or fp16
    high: torch.Tensor | None = None  # q5: uint8 [N, K/8], bit i of byte j = 5th bit of code 8j + i
    out_features: int = 0
    in_features: int = 0
    compute_dtype: torch.dtype = torch.float32  # what rows() returns: the model's dtype
    tiled: bool = False  # codes [N/16, groups, 512], high [N/16, groups, 128], scales [N/16, groups, 16]

    @property
    def device(self) -> torch.device:
        return self.codes.device

    @property
    def nbytes(self) -> int:
        return self.codes.nbytes + self.scales.nbytes + (0 if self.high is None else self.high.nbytes)

    def matmul(self, x: torch.Tensor, partial: bool = False):
        """x [..., K] @ W.T -> [..., N] (or, with `partial`, a split-K launch's unsummed `SplitK`)."""
        from ..kernels.qmatmul import qlinear

        return qlinear(x, self, partial)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Dequantized rows (an embedding lookup)."""
        if self.tiled:  # the tiles that hold the rows, untiled, then the rows within them
            tiles = ids // 16
            sub = untile(QuantizedWeight(self.fmt, self.codes[tiles], self.scales[tiles], self.high[tiles]
                                         if self.high is not None else None, 16 * len(ids), self.in_features,
                                         self.compute_dtype, tiled=True))
            return dequantize(sub, self.compute_dtype)[torch.arange(len(ids), device=ids.device) * 16 + ids % 16]
        sub = QuantizedWeight(self.fmt, self.codes[ids], self.scales[ids],
                              None if self.high is None else self.high[ids], len(ids), self.in_features)
        return dequantize(sub, self.compute_dtype)


def concat_rows(parts: list):
    """Stack weights that read the same input into one (their outputs side by side): plain tensors, or
    quantized ones of one format (rows are independent, so codes, scales and bit planes stack as they are)."""
    if all(isinstance(p, torch.Tensor) for p in parts):
        return torch.cat(parts, dim=0)
    if any(isinstance(p, gguf_blocks.GGUFWeight) for p in parts):
        return gguf_blocks.concat(parts)
    if not all(isinstance(p, QuantizedWeight) and p.fmt == parts[0].fmt for p in parts):
        raise ValueError("weights fused into one projection must share one storage format")
    if any(p.tiled for p in parts) and not all(p.tiled for p in parts):  # a part too short to tile
        return prefer_tiles(concat_rows([untile(p) if p.tiled else p for p in parts]))
    high = None if parts[0].high is None else torch.cat([p.high for p in parts])
    return QuantizedWeight(parts[0].fmt, torch.cat([p.codes for p in parts]), torch.cat([p.scales for p in parts]),
                           high, sum(p.out_features for p in parts), parts[0].in_features, parts[0].compute_dtype,
                           parts[0].tiled)  # tiles stack like rows: each part is whole tiles of 16 rows


def quantize(w: torch.Tensor, fmt: str) -> QuantizedWeight:
    """Round-to-nearest per group of GROUP weights along K; the scale maps the group's absmax onto the top code."""
    if fmt not in FORMATS:
        raise ValueError(f"unknown weight format {fmt!r}")
    n, k = w.shape
    if k % GROUP:
        raise ValueError(f"in_features {k} is not a multiple of the group size {GROUP}")
    qmax = _QMAX[fmt]
    groups = w.float().reshape(n, k // GROUP, GROUP)
    absmax = groups.abs().amax(-1)
    # divided by a tensor, not a Python number: CUDA turns division by a host scalar into a multiplication by its
    # reciprocal, one bit off at times, and a weight quantized on the GPU at load must equal one `ninfer
    # convert` quantized on the CPU
    scale = (absmax / absmax.new_full((), qmax)).clamp_min(1e-12)
    codes = torch.round(groups / scale[..., None]).clamp_(-qmax - (fmt != "q8"), qmax).to(torch.int16)
    codes = codes.reshape(n, k)
    # 16-bit scales whatever the compute dtype (the byte count the memory plan uses): bf16 with bf16 models,
    # fp16 (more mantissa) otherwise.
    scales = scale.to(torch.bfloat16 if w.dtype == torch.bfloat16 else torch.float16)
    if fmt == "q8":
        return QuantizedWeight(fmt, codes.to(torch.int8), scales, None, n, k, w.dtype)
    offset = 8 if fmt == "q4" else 16
    u = (codes + offset).to(torch.uint8)  # 0..15 (q4) or 0..31 (q5)
    low = u & 0xF
    nibbles = (low[:, 0::2] | (low[:, 1::2] << 4)).contiguous()
    high = None
    if fmt == "q5":
        bits = (u >> 4).reshape(n, k // 8, 8).to(torch.int32)
        high = (bits << torch.arange(8, device=w.device, dtype=torch.int32)).sum(-1).to(torch.uint8)
    return QuantizedWeight(fmt, nibbles, scales, high, n, k, w.dtype)


def tileable(q: QuantizedWeight) -> bool:
    """Whether the tiled kernels take this weight: q4/q5, whole tiles of 16 rows, groups in fours (their
    smallest unroll)."""
    return q.fmt in ("q4", "q5") and q.out_features % 16 == 0 and (q.in_features // GROUP) % 4 == 0


def tile(q: QuantizedWeight) -> QuantizedWeight:
    """The tiled layout of a row-major q4/q5 weight (see `kernels/qtiled.py` for the lane order)."""
    assert tileable(q) and not q.tiled
    n, groups = q.out_features, q.in_features // GROUP
    # [N, K/2] = [tile, half, gid, group, tid, byte] -> [tile, group, gid, tid, half, byte]
    codes = q.codes.view(n // 16, 2, 8, groups, 4, 8).permute(0, 3, 2, 4, 1, 5).reshape(n // 16, groups, 512)
    high = None
    if q.high is not None:  # [N, K/8]: 8 bytes per row and group, 2 per lane
        high = q.high.view(n // 16, 2, 8, groups, 4, 2).permute(0, 3, 2, 4, 1, 5).reshape(n // 16, groups, 128)
    scales = q.scales.view(n // 16, 16, groups).permute(0, 2, 1).contiguous()
    return replace(q, codes=codes, scales=scales, high=high, tiled=True)


def untile(q: QuantizedWeight) -> QuantizedWeight:
    """The row-major layout of a tiled weight (a new copy; the weight itself if it is not tiled)."""
    if not q.tiled:
        return q
    n, groups = q.out_features, q.in_features // GROUP
    codes = q.codes.view(n // 16, groups, 8, 4, 2, 8).permute(0, 4, 2, 1, 3, 5).reshape(n, groups * 32)
    high = None
    if q.high is not None:
        high = q.high.view(n // 16, groups, 8, 4, 2, 2).permute(0, 4, 2, 1, 3, 5).reshape(n, groups * 8)
    scales = q.scales.permute(0, 2, 1).reshape(n, groups)
    return replace(q, codes=codes, scales=scales, high=high, tiled=False)


def prefer_tiles(q: QuantizedWeight) -> QuantizedWeight:
    """The tiled layout where the tiled kernels run (an sm_80+ GPU with NVRTC), else the weight as it is."""
    if q.tiled or not tileable(q):
        return q
    from ..kernels import qtiled

    return tile(q) if qtiled.usable(q.device) else q


def first_rows(w, n: int):
    """The first `n` output rows of a plain or quantized weight, as a view (rows are stored apart in every
    layout: row-major, or tiles of 16 rows)."""
    if not isinstance(w, QuantizedWeight):
        return w[:n]
    cut = n // 16 if w.tiled else n
    assert not w.tiled or n % 16 == 0
    return replace(w, codes=w.codes[:cut], scales=w.scales[:cut], high=None if w.high is None else w.high[:cut],
                   out_features=n)


def codes_of(q: QuantizedWeight) -> torch.Tensor:
    """The signed integer codes [N, K] (int16)."""
    q = untile(q)
    if q.fmt == "q8":
        return q.codes.to(torch.int16)
    n, k = q.codes.shape[0], q.in_features
    u = torch.empty(n, k, dtype=torch.int16, device=q.codes.device)
    u[:, 0::2] = (q.codes & 0xF).to(torch.int16)
    u[:, 1::2] = (q.codes >> 4).to(torch.int16)
    if q.fmt == "q4":
        return u - 8
    bits = (q.high.to(torch.int16)[..., None] >> torch.arange(8, device=q.codes.device, dtype=torch.int16)) & 1
    return u + (bits.reshape(n, k) << 4) - 16


def dequantize(q: QuantizedWeight, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The reference: codes x scales, computed in fp32."""
    q = untile(q)
    c = codes_of(q).float().reshape(q.codes.shape[0], -1, GROUP)
    return (c * q.scales.float()[..., None]).reshape(q.codes.shape[0], q.in_features).to(dtype)


def load_transform(formats, tiled: bool = False):
    """The per-tensor hook loaders apply as each weight arrives, so the unquantized model never has to fit in
    memory whole; None when every class keeps its checkpoint format. `tiled`: q4/q5 weights take the tiled
    layout where the CUDA kernels run (`prefer_tiles`), else stay row-major (the Triton kernels)."""
    from ..memory_plan import weight_class

    wanted = formats.as_dict()
    if all(v == "auto" for v in wanted.values()):
        return None

    def transform(name: str, w: torch.Tensor):
        fmt = wanted.get(weight_class(name), "auto")
        if fmt in FORMATS and w.dim() == 2 and w.shape[1] % GROUP == 0:
            q = quantize(w, fmt)
            return prefer_tiles(q) if tiled else q
        if fmt == "bf16" and w.dim() == 2:
            return w.to(torch.bfloat16)
        return w

    return transform
