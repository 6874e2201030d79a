"""Layers shared by the model definitions, in plain torch (the reference every kernel is checked against)."""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from ..kernels import cpu_layers
from ..kernels.actquant import QuantRows
from ..kernels.qmatmul import SplitK
from ..quant.packed import PackedWeight
from ..quant.qweight import concat_rows
from .spec import RopeSpec


def linear(x: torch.Tensor | QuantRows, w, partial: bool = False) -> torch.Tensor | SplitK:
    """x @ w.T for a plain weight or a group-quantized one (fused dequant kernel on GPU); x may come with its
    int8 rows made by the kernel that produced it (see `feeds` below). `partial`: the output goes into
    `add_rms_norm` as its residual, which sums a split-K launch's partials itself (else `dense()` them)."""
    if isinstance(w, PackedWeight):  # group-quantized (GPU kernels), or GGUF blocks (CPU kernels)
        return w.matmul(x, partial)
    return F.linear(x.x if isinstance(x, QuantRows) else x, w)


def dense(h: torch.Tensor | SplitK) -> torch.Tensor:
    return h.dense() if isinstance(h, SplitK) else h


def int8_split(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, feeds) -> bool | None:
    """For producers with a `feeds` weight: whether (and how) to write int8 rows for the quantized matmul of
    `feeds` that reads their output next (saving its separate activation-quantize launch)."""
    if feeds is None:
        return None
    from ..kernels.qmatmul import int8_rows_wanted

    return int8_rows_wanted(shape, dtype, device, feeds)


def embed(ids: torch.Tensor, table) -> torch.Tensor:
    return table.rows(ids) if isinstance(table, PackedWeight) else F.embedding(ids, table)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, zero_centred: bool = False,
             feeds=None) -> torch.Tensor | QuantRows:
    """RMSNorm in fp32 (fp64 for fp64 inputs). `zero_centred` scales by (1 + w), cast after the multiply
    (Qwen3.5/Gemma order); otherwise by w after casting back (llama order). The orders differ only below fp32.
    On a GPU one fused kernel does it (`engine/kernels/norm.py`); `rms_norm_reference` is its reference.
    `feeds`: the weight the output goes into (as in `add_rms_norm`)."""
    return add_rms_norm(x, None, weight, eps, zero_centred, feeds)[1]


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float, zero_centred: bool = False) -> torch.Tensor:
    acc = torch.promote_types(x.dtype, torch.float32)
    xf = x.to(acc)
    normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    if zero_centred:
        return (normed * (1.0 + weight.to(acc))).to(x.dtype)
    return weight * normed.to(x.dtype)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor | SplitK | None, weight: torch.Tensor, eps: float,
                 zero_centred: bool = False, feeds=None) -> tuple[torch.Tensor, torch.Tensor | QuantRows]:
    """(x + residual, rms_norm of it): a decoder layer's residual add and the next norm, one kernel on a GPU.
    A None residual adds nothing (the first layer); a SplitK one is summed on the way in. `feeds`: the weight
    the norm's output goes into."""
    from ..kernels import norm

    if norm.usable(x, weight):
        return norm.add_rms_norm(x, residual, weight, eps, zero_centred,
                                 int8_split(x.shape, x.dtype, x.device, feeds))
    if not isinstance(residual, SplitK) and cpu_layers.usable(x, weight, *(() if residual is None else (residual,))):
        return cpu_layers.add_rms_norm(x, residual, weight, eps, zero_centred)
    if residual is not None:
        x = x + dense(residual)
    return x, rms_norm_reference(x, weight, eps, zero_centred)


def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float,
                   dtype: torch.dtype, feeds=None) -> torch.Tensor | QuantRows:
    """Plain-order RMSNorm of the heads of x [T, H, D] (cast to `dtype` first) times silu(gate) in fp32, cast
    to `dtype`, as [T, H * D]: the output gate of Qwen3.5's GDN layers."""
    from ..kernels import norm

    if norm.usable(x, weight, dtype):
        split = int8_split((x.shape[0], x.shape[1] * x.shape[2]), dtype, x.device, feeds)
        return norm.gated_rms_norm(x, gate, weight, eps, dtype, split)
    acc = torch.promote_types(dtype, torch.float32)
    return (rms_norm_reference(x.to(dtype), weight, eps) * F.silu(gate.to(acc))).to(dtype).reshape(x.shape[0], -1)


def norm_rope(x: torch.Tensor, weight: torch.Tensor, eps: float, rope: Rope, cos: torch.Tensor,
              sin: torch.Tensor, zero_centred: bool = False) -> torch.Tensor:
    """RMSNorm of each head of x [T, H, D], then RoPE: the q/k norms of Qwen3-style attention."""
    from ..kernels import norm

    if norm.usable(x, weight):
        return norm.rms_norm_rope(x, weight, eps, zero_centred, cos, sin, rope.rotary_dim)
    return rope.apply(rms_norm_reference(x, weight, eps, zero_centred), cos, sin)


def norm_rope_pair(q: torch.Tensor, k: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor, eps: float,
                   rope: Rope, cos: torch.Tensor, sin: torch.Tensor,
                   zero_centred: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """`norm_rope` of q and of k, in one launch on a GPU (a decode step's 16 attention layers: 16 launches)."""
    from ..kernels import norm

    if norm.usable(q, q_weight) and norm.usable(k, k_weight):
        return norm.rms_norm_rope_pair(q, k, q_weight, k_weight, eps, zero_centred, cos, sin, rope.rotary_dim)
    return (norm_rope(q, q_weight, eps, rope, cos, sin, zero_centred),
            norm_rope(k, k_weight, eps, rope, cos, sin, zero_centred))


def output_logits(x: torch.Tensor, norm: torch.Tensor, lm_head, eps: float, zero_centred: bool, all_logits: bool,
                  taps=None) -> torch.Tensor:
    """Final norm + LM head over the last position (or all of them), in fp32; keeps the normed hidden states
    in `taps` when a drafter reads them. Where the head reads every row the norm writes, the norm also
    writes the head's int8 rows."""
    keep = taps is not None and taps.final
    feeds = lm_head if all_logits or not keep else None
    normed = rms_norm(x if all_logits or keep else x[-1:], norm, eps, zero_centred, feeds)
    if keep:
        taps.hidden = normed.x if isinstance(normed, QuantRows) else normed
        if not all_logits:
            normed = normed[-1:]
    return linear(normed, lm_head).to(torch.promote_types(x.dtype, torch.float32))


class Rope:
    """NeoX (rotate-half) rotary embedding on the first `rotary_dim` dims of each head."""

    def __init__(self, spec: RopeSpec, head_dim: int, device: torch.device,
                 freq_factors: torch.Tensor | None = None) -> None:
        self.rotary_dim = spec.rotary_dim or head_dim
        exponent = torch.arange(0, self.rotary_dim, 2, dtype=torch.float64) / self.rotary_dim
        inv_freq = 1.0 / (spec.theta ** exponent)
        if spec.scaling_type == "linear":
            inv_freq = inv_freq / spec.factor
        elif spec.scaling_type == "llama3":
            inv_freq = _llama3_scale(inv_freq, spec)
        if freq_factors is not None:
            inv_freq = inv_freq / freq_factors.double().cpu()
        self.inv_freq = inv_freq.to(device)  # fp64: angles of long positions keep their precision
        # M-RoPE: the axis whose coordinate turns each frequency (interleaved t h w t h w ..., each axis up to
        # its section; the rest stay on time), as transformers' qwen3_5 recomposes them
        sections = spec.mrope_section
        self.axis = torch.tensor([a if a and i < 3 * sections[a] else 0 for i in range(len(inv_freq))
                                  for a in (i % 3,)], device=device) if sections else None

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [T], or [3, T] M-RoPE coordinates (time, row, column) of each token."""
        if positions.dim() == 2:
            angles = positions.double()[:, :, None] * self.inv_freq  # [3, T, F]
            freqs = angles.gather(0, self.axis.expand(1, positions.shape[1], -1))[0]
        else:
            freqs = positions.double()[:, None] * self.inv_freq[None, :]
        emb = torch.cat([freqs, freqs], dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)

    def apply(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x: [T, H, D]; cos/sin: [T, rotary_dim]."""
        if cpu_layers.usable(x, cos):
            return cpu_layers.rope(x, cos, sin, self.rotary_dim)
        rot, rest = x[..., : self.rotary_dim], x[..., self.rotary_dim :]
        half = self.rotary_dim // 2
        rotated = torch.cat([-rot[..., half:], rot[..., :half]], dim=-1)
        out = rot * cos[:, None, :] + rotated * sin[:, None, :]
        return torch.cat([out, rest], dim=-1) if rest.shape[-1] else out


def _llama3_scale(inv_freq: torch.Tensor, spec: RopeSpec) -> torch.Tensor:
    low_wavelen = spec.original_max_position / spec.low_freq_factor
    high_wavelen = spec.original_max_position / spec.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / spec.factor, inv_freq)
    span = spec.high_freq_factor - spec.low_freq_factor
    smooth = (spec.original_max_position / wavelen - spec.low_freq_factor) / span
    mid = (1 - smooth) * scaled / spec.factor + smooth * scaled
    is_mid = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(is_mid, mid, scaled)


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int, scale: float) -> torch.Tensor:
    """q: [T, H, D] at absolute positions start..start+T-1; k, v: [start+T, Hkv, D]. Returns [T, H, D]."""
    t, length = q.shape[0], k.shape[0]
    qh, kh, vh = q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None]
    # The queries sit at the end of the keys: torch's lower-right causal bias, which SDPA's fused kernels take
    # without a [T, L] mask tensor (faster than a boolean mask at long contexts: scripts/bench_prefill_attention.py
    # times both). Its module imports torch._dynamo (seconds of a CPU start); on a CPU SDPA has no kernel that
    # takes the bias, and torch hands it on as the two calls below, so they are made directly.
    mask, causal = None, False
    if t > 1 and q.device.type != "cpu":
        from torch.nn.attention.bias import causal_lower_right

        mask = causal_lower_right(t, length)
    elif t > 1:
        causal = t == length
        mask = None if causal else torch.ones(t, length, dtype=torch.bool, device=q.device).tril(length - t)
    out = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, is_causal=causal, scale=scale, enable_gqa=True)
    return out[0].transpose(0, 1)


def cached_attention(q: torch.Tensor, kv, layer: int, start: int, positions: torch.Tensor,
                     scale: float, gate: torch.Tensor | None = None, feeds=None) -> torch.Tensor | QuantRows:
    """Attention of q [T, H, D] at `positions` (= start..start+T-1) over layer `layer` of the KV cache, which
    already holds these tokens, times sigmoid(gate [T, H, D]) when gated. Decode/verify steps on a GPU take the
    kernel, which reads the positions on the device (what a captured CUDA graph needs); longer steps and the CPU
    take the reference over the prefix. `feeds`: the weight the output goes into (the kernel may then return
    QuantRows of [T, H * D] with its int8 rows)."""
    from ..kernels import attention

    if attention.usable(q):
        t, h, d = q.shape
        return attention.decode_attention(q, kv, layer, positions, scale, gate,
                                          quant_split=int8_split((t, h * d), q.dtype, q.device, feeds))
    keys, values = kv.read(layer, start + q.shape[0])
    if q.shape[0] <= cpu_layers.MAX_ATTENTION_ROWS and cpu_layers.usable(q, keys):
        out = cpu_layers.attention(q, keys, values, start, scale)
    else:
        out = causal_attention(q, keys, values, start, scale)
    return out if gate is None else out * torch.sigmoid(gate)


def release(weights: dict, prefix: str) -> None:
    """Drop a built layer's source tensors from the loaded dict (the model owns it): fused copies would
    otherwise double the weights' memory until loading ends."""
    for name in [n for n in weights if n.startswith(prefix)]:
        del weights[name]


def fuse(w: dict, keys: tuple[str, ...], name: str) -> None:
    """Replace the projections `keys` of a layer, which read the same input, by one (`name`): one matmul launch
    instead of several; the caller splits its output by the parts' sizes."""
    w[name] = concat_rows([w.pop(k) for k in keys])


def swiglu(x: torch.Tensor | QuantRows, gate_up, down, partial: bool = False) -> torch.Tensor | SplitK:
    """SwiGLU with the gate and up projections fused into one weight (gate rows first); `partial` as in linear.
    The activation kernel sums gate|up's split-K partials itself."""
    return linear(silu_mul(linear(x, gate_up, partial=True), feeds=down), down, partial)


def silu_mul(gate_up: torch.Tensor | SplitK, feeds=None) -> torch.Tensor | QuantRows:
    """silu(gate) * up for [..., 2F] = [gate | up], one kernel on a GPU (which sums a SplitK's partials).
    `feeds`: the weight it goes into."""
    from ..kernels import activation

    if activation.usable(gate_up):
        shape = (*gate_up.shape[:-1], gate_up.shape[-1] // 2)
        return activation.silu_mul(gate_up, int8_split(shape, gate_up.dtype, gate_up.device, feeds))
    if cpu_layers.usable(gate_up):
        return cpu_layers.silu_mul(gate_up)
    gate, up = dense(gate_up).chunk(2, dim=-1)
    return F.silu(gate) * up
