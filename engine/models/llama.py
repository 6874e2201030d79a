"""Llama-family decoder (RMSNorm, RoPE, GQA, SwiGLU), reference path in plain torch."""
from __future__ import annotations

import torch

from ..cache.kv_cache import KVCache
from ..cache.kv_pool import KVPool, StoreSpec
from ..cache.sequence import SequenceCache
from ..errors import ModelFormatError
from ..kernels.cpu_decode import MAX_ROWS, LlamaLayers
from ..kernels.qmatmul import SplitK
from .decoder import BatchStep, Segment, segment_attention, segment_rows
from .layers import (
    Rope,
    add_rms_norm,
    dense,
    embed,
    fuse,
    linear,
    release,
    swiglu,
)
from .spec import ModelSpec
from .taps import Taps


def check_weights(weights: dict[str, torch.Tensor], shapes: dict[str, tuple[int, ...]]) -> None:
    """Every weight the spec implies is present with its shape; the first problem is named."""
    for name, shape in shapes.items():
        if name not in weights:
            raise ModelFormatError(f"model weights lack tensor {name!r}")
        if tuple(weights[name].shape) != shape:
            raise ModelFormatError(f"tensor {name!r} has shape {tuple(weights[name].shape)}, "
                                   f"the config implies {shape}")


def common_shapes(s: ModelSpec) -> dict[str, tuple[int, ...]]:
    """Embedding, head, final norm and the per-layer norms + MLP, shared by every architecture here."""
    h = s.hidden_size
    shapes = {"embed_tokens.weight": (s.vocab_size, h), "norm.weight": (h,)}
    if not s.tie_embeddings:
        shapes["lm_head.weight"] = (s.vocab_size, h)
    for i in range(s.num_layers):
        p = f"layers.{i}."
        shapes.update({p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
                       p + "mlp.gate_proj.weight": (s.intermediate_size, h),
                       p + "mlp.up_proj.weight": (s.intermediate_size, h),
                       p + "mlp.down_proj.weight": (h, s.intermediate_size)})
    return shapes


def attention_shapes(s: ModelSpec, layer: int, gated: bool = False) -> dict[str, tuple[int, ...]]:
    p, h = f"layers.{layer}.self_attn.", s.hidden_size
    q_rows = s.num_heads * s.head_dim * (2 if gated else 1)
    kv_rows = s.num_kv_heads * s.head_dim
    return {p + "q_proj.weight": (q_rows, h), p + "k_proj.weight": (kv_rows, h), p + "v_proj.weight": (kv_rows, h),
            p + "o_proj.weight": (h, s.num_heads * s.head_dim)}


class LlamaModel(BatchStep):
    @staticmethod
    def fused_weights() -> tuple[tuple[str, ...], ...]:
        """The weights each layer fuses into one (`fuse`), by name after the layer's prefix."""
        return tuple(tuple(f"{_LAYER_KEYS[k]}.weight" for k in keys) for keys in (QKV, GATE_UP))

    @staticmethod
    def weight_shapes(spec: ModelSpec) -> dict[str, tuple[int, ...]]:
        shapes = common_shapes(spec)
        for i in range(spec.num_layers):
            shapes.update(attention_shapes(spec, i))
        return shapes

    def __init__(self, spec: ModelSpec, weights: dict[str, torch.Tensor], kv_dtype: str = "auto") -> None:
        check_weights(weights, self.weight_shapes(spec))
        self.geometry, self.kv_dtype = spec, kv_dtype
        self.embed = weights["embed_tokens.weight"]
        self.device, self.dtype = self.embed.device, self.embed.dtype
        self.lm_head = self.embed if spec.tie_embeddings else weights["lm_head.weight"]
        self.norm = weights["norm.weight"]
        self.layers = []
        for i in range(spec.num_layers):
            w = {key: weights[f"layers.{i}.{name}.weight"] for key, name in _LAYER_KEYS.items()}
            fuse(w, QKV, "qkv")
            fuse(w, GATE_UP, "gate_up")
            self.layers.append(w)
            release(weights, f"layers.{i}.")
        kv_rows = spec.num_kv_heads * spec.head_dim
        self.qkv_split = (spec.num_heads * spec.head_dim, kv_rows, kv_rows)
        self.rope = Rope(spec.rope, spec.head_dim, self.device, weights.get("rope_freqs"))
        self.scale = spec.head_dim ** -0.5
        # each layer of a CPU decode step in one C call, where the kernels take these weights
        self.cpu_layers = LlamaLayers.build(spec, self.layers, self.rope.rotary_dim, self.scale) \
            if self.device.type == "cpu" else None

    def kv_spec(self) -> StoreSpec:
        s = self.geometry
        return StoreSpec(s.num_layers, s.num_kv_heads, s.head_dim, self.kv_dtype, self.dtype)

    def new_cache(self, max_len: int, pool: KVPool | None = None) -> SequenceCache:
        """A sequence of up to `max_len` tokens: its KV in `pool` (no blocks yet), or in a pool of its own."""
        return SequenceCache(kv=KVCache.new(self.kv_spec(), max_len, self.device, pool))

    def _decoder(self, ids: torch.Tensor, segments: list[Segment], positions: torch.Tensor,
                 taps: Taps | None) -> torch.Tensor:
        """The decoder layers over the rows of `ids` (rows of several sequences: `segments`); the last hidden
        states, before the final norm."""
        cos, sin = self.rope.cos_sin(positions, self.dtype)
        x = embed(ids, self.embed)
        h = None  # the last block's output, added to x by the next norm (one kernel for add + norm)
        runs = self._cpu_runs(x, segments, cos, sin, taps is not None)
        if runs is not None:  # every layer in C, a call for each group of sequences (keeping the tapped outputs)
            outs = [run(taps) for run in runs]
            return torch.cat([a + b for a, b in outs]) if len(outs) > 1 else outs[0][0] + outs[0][1]
        for i, w in enumerate(self.layers):
            x, h = self._layer(i, w, x, h, segments, positions, cos, sin)
            if taps is not None and i in taps.layer_ids:
                taps.keep(i, x + dense(h))
        return x + dense(h)

    def _cpu_runs(self, x: torch.Tensor, segments: list[Segment], cos: torch.Tensor, sin: torch.Tensor,
                  tapped: bool) -> list | None:
        """The C layers' runs over the step's rows, sequences grouped in order up to the rows one call takes (the
        weights read once for each group), or None where the torch ops must run the step: a prefill chunk, or a
        tapped step that needs more than one call (a tap keeps the step's rows at once)."""
        if not self.cpu_layers:
            return None
        groups: list[list] = []
        rows = 0
        for cache, r in segment_rows(segments, x.shape[0]):
            n = r.stop - r.start
            if not groups or rows + n > MAX_ROWS:
                groups.append([])
                rows = 0
            groups[-1].append((cache.kv, cache.length, n))
            rows += n
        if tapped and len(groups) > 1:
            return None
        runs, first = [], 0
        for group in groups:
            end = first + sum(n for _, _, n in group)
            run = self.cpu_layers.step(x[first:end], group, cos[first:end], sin[first:end])
            if run is None:
                return None
            runs.append(run)
            first = end
        return runs

    def _layer(self, i: int, w: dict, x: torch.Tensor, h, segments: list[Segment], positions: torch.Tensor,
               cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | SplitK]:
        """Layer i over x plus the last layer's output h: (x + h + attention, the MLP's output)."""
        s, t = self.geometry, x.shape[0]
        x, a = add_rms_norm(x, h, w["in_norm"], s.rms_eps)
        q, k, v = linear(a, w["qkv"]).split(self.qkv_split, dim=-1)
        q = self.rope.apply(q.reshape(t, s.num_heads, s.head_dim), cos, sin)
        k = self.rope.apply(k.reshape(t, s.num_kv_heads, s.head_dim), cos, sin)
        v = v.reshape(t, s.num_kv_heads, s.head_dim)
        attn = segment_attention(q, k, v, segments, i, positions, self.scale)
        x, a = add_rms_norm(x, linear(attn.reshape(t, -1), w["o"], partial=True), w["post_norm"], s.rms_eps)
        return x, swiglu(a, w["gate_up"], w["down"], partial=True)


# the projections fused into one weight each: they read the same input
QKV, GATE_UP = ("q", "k", "v"), ("gate", "up")
_LAYER_KEYS = {
    "in_norm": "input_layernorm", "post_norm": "post_attention_layernorm",
    "q": "self_attn.q_proj", "k": "self_attn.k_proj", "v": "self_attn.v_proj", "o": "self_attn.o_proj",
    "gate": "mlp.gate_proj", "up": "mlp.up_proj", "down": "mlp.down_proj",
}
