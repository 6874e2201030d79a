"""Qwen3.5/3.6 hybrid decoder: Gated DeltaNet layers + gated full-attention layers, dense SwiGLU MLP.

Follows transformers' `models/qwen3_5` definition: every RMSNorm is zero-centred (1 + w) except the GDN output
norm (plain w, gated by silu(z)); q_proj rows are per head [query | gate]; partial NeoX RoPE; MTP weights are
kept for speculative decoding.
"""
from __future__ import annotations

from dataclasses import replace
from functools import partial

import torch

from ..cache.kv_cache import KVCache
from ..cache.kv_pool import KVPool, StoreSpec
from ..cache.sequence import SequenceCache
from ..cache.state_slots import GDNState, KeptInputs
from ..kernels.actquant import QuantRows
from .decoder import BatchStep, Segment, StepMedia, joined, segment_attention, segment_rows
from .gdn import GDNHeads, chunked_update_, conv_step_, output_gate, recurrent_update_, replay_
from .layers import (
    Rope,
    add_rms_norm,
    dense,
    embed,
    fuse,
    gated_rms_norm,
    linear,
    norm_rope_pair,
    release,
    swiglu,
)
from .llama import attention_shapes, check_weights, common_shapes
from .spec import ModelSpec
from .taps import Taps

RECURRENT_MAX_T = 8  # decode/verify steps (T <= 8) take the token-by-token form; longer chunks the WY form
# Steps that keep their GDN inputs for a commit: verify steps (T <= 8) and graphed prefill pieces (16 tokens, padded
# like verify steps; `runtime/runner.py`), which take the token-by-token form too.
KEPT_MAX_T = 16


class Qwen35Model(BatchStep):
    ZERO_CENTRED_NORM = True

    @staticmethod
    def fused_weights() -> tuple[tuple[str, ...], ...]:
        """The weights each layer fuses into one (`fuse`), by name after the layer's prefix."""
        return (tuple(f"linear_attn.{_GDN_KEYS[k]}.weight" for k in IN_PROJ),
                tuple(f"self_attn.{_ATTN_KEYS[k]}.weight" for k in QKV),
                tuple(f"{_COMMON_KEYS[k]}.weight" for k in GATE_UP))

    @staticmethod
    def weight_shapes(spec: ModelSpec) -> dict[str, tuple[int, ...]]:
        s, h = spec, spec.hidden_size
        hv = s.linear_num_value_heads
        key_dim, value_dim = s.linear_num_key_heads * s.linear_key_head_dim, hv * s.linear_value_head_dim
        conv_dim = 2 * key_dim + value_dim
        shapes = common_shapes(s)
        for i, kind in enumerate(s.kinds()):
            if kind == "full_attention":
                shapes.update(attention_layer_shapes(s, f"layers.{i}."))
            else:
                p = f"layers.{i}.linear_attn."
                shapes.update({p + "in_proj_qkv.weight": (conv_dim, h), p + "in_proj_z.weight": (value_dim, h),
                               p + "in_proj_b.weight": (hv, h), p + "in_proj_a.weight": (hv, h),
                               p + "conv1d.weight": (conv_dim, 1, s.linear_conv_kernel), p + "A_log": (hv,),
                               p + "dt_bias": (hv,), p + "norm.weight": (s.linear_value_head_dim,),
                               p + "out_proj.weight": (h, value_dim)})
        return shapes

    def __init__(self, spec: ModelSpec, weights: dict[str, torch.Tensor], kv_dtype: str = "auto") -> None:
        check_weights(weights, self.weight_shapes(spec))
        self.geometry, self.kv_dtype = spec, kv_dtype
        s = spec
        self.embed = weights["embed_tokens.weight"]
        self.device, self.dtype = self.embed.device, self.embed.dtype
        self.lm_head = self.embed if s.tie_embeddings else weights["lm_head.weight"]
        self.norm = weights["norm.weight"]
        self.key_dim = s.linear_num_key_heads * s.linear_key_head_dim
        self.value_dim = s.linear_num_value_heads * s.linear_value_head_dim
        self.conv_dim = 2 * self.key_dim + self.value_dim
        self.heads = GDNHeads(s.linear_num_key_heads, s.linear_key_head_dim, s.linear_num_value_heads,
                              s.linear_value_head_dim)
        self.layers: list[dict] = []
        self.full_index: dict[int, int] = {}  # layer -> slot in the KV cache
        self.linear_index: dict[int, int] = {}  # layer -> slot in the GDN state
        for i, kind in enumerate(s.kinds()):
            p = f"layers.{i}."
            if kind == "full_attention":
                w = attention_layer(weights, p)
                self.full_index[i] = len(self.full_index)
            else:
                w = {"kind": kind, **{key: weights[p + name + ".weight"] for key, name in _COMMON_KEYS.items()}}
                a = p + "linear_attn."
                w.update({key: weights[a + name + ".weight"] for key, name in _GDN_KEYS.items()})
                w["conv"] = w["conv"].reshape(self.conv_dim, -1)
                fuse(w, IN_PROJ, "in_proj")
                fuse(w, GATE_UP, "gate_up")
                acc = torch.promote_types(self.dtype, torch.float32)
                w["a_log"] = weights[a + "A_log"].to(acc)  # fla-core's prefill takes A_log itself
                w["neg_a"] = -w["a_log"].exp()  # once here, not per decode step
                w["dt_bias"] = weights[a + "dt_bias"].to(acc)
                self.linear_index[i] = len(self.linear_index)
            self.layers.append(w)
            release(weights, p)
        gdn = [self.layers[i] for i in self.linear_index]  # in slot order
        # a verify step's commit replays its kept tokens into every GDN layer at once, with all layers' rates
        self.replay = partial(replay_, neg_a=torch.stack([w["neg_a"] for w in gdn]) if gdn else None,
                              dt_bias=torch.stack([w["dt_bias"] for w in gdn]) if gdn else None, heads=self.heads)
        self.mtp = {k: v for k, v in weights.items() if k.startswith("mtp.")}
        self.rope = Rope(s.rope, s.head_dim, self.device)
        self.scale = s.head_dim ** -0.5

    def kv_spec(self) -> StoreSpec:
        s = self.geometry
        return StoreSpec(len(self.full_index), s.num_kv_heads, s.head_dim, self.kv_dtype, self.dtype)

    def new_cache(self, max_len: int, pool: KVPool | None = None) -> SequenceCache:
        """A sequence of up to `max_len` tokens: its KV in `pool` (no blocks yet), or in a pool of its own."""
        s = self.geometry
        kv = KVCache.new(self.kv_spec(), max_len, self.device, pool)
        states = GDNState.zeros(len(self.linear_index), s.linear_conv_kernel, self.conv_dim,
                                s.linear_num_value_heads, s.linear_key_head_dim, s.linear_value_head_dim,
                                self.dtype, self.device)
        return SequenceCache(kv=kv, states=states)

    def _keep_inputs(self, cache: SequenceCache, tokens: int) -> None:
        """A verify step (or a graphed prefill piece, up to KEPT_MAX_T tokens) keeps every token's GDN inputs,
        the recurrent state unchanged, until `cache.commit`."""
        cache.kept = KeptInputs.like(cache.states, tokens, self.geometry.linear_num_value_heads, self.replay)

    def _decoder(self, ids: torch.Tensor, segments: list[Segment], positions: torch.Tensor,
                 taps: Taps | None, media: StepMedia | None = None) -> torch.Tensor:
        """The decoder layers over the rows of `ids` (rows of several sequences: `segments`); the last hidden
        states, before the final norm. With `media`, image pads take the tower's embeddings and the attention
        layers rotate by M-RoPE coordinates (the GDN layers know no positions)."""
        s = self.geometry
        cos, sin = self.rope.cos_sin(positions if media is None else media.positions, self.dtype)
        x = embed(ids, self.embed)
        if media is not None and media.rows.numel():
            x = x.index_copy(0, media.rows, media.embeds.to(x.dtype))
        h = None  # the last block's output, added to x by the next norm (one kernel for add + norm)
        for i, w in enumerate(self.layers):
            attn = w["kind"] == "full_attention"
            x, a = add_rms_norm(x, h, w["in_norm"], s.rms_eps, zero_centred=True,
                                feeds=w["qkv"] if attn else w["in_proj"])
            if attn:
                h = self.attention(a, w, segments, self.full_index[i], positions, cos, sin)
            else:
                h = self._gdn(a, w, segments, self.linear_index[i])
            x, a = add_rms_norm(x, h, w["post_norm"], s.rms_eps, zero_centred=True, feeds=w["gate_up"])
            h = swiglu(a, w["gate_up"], w["down"], partial=True)
            if taps is not None and i in taps.layer_ids:
                taps.keep(i, x + dense(h))
        return x + dense(h)

    def attention(self, x, w, segments: list[Segment], slot: int, positions, cos, sin):
        """Gated attention over the step's rows; each segment's rows attend over their own sequence's KV."""
        s, t = self.geometry, x.shape[0]
        q_rows = s.num_heads * s.head_dim * (2 if s.attn_output_gate else 1)
        kv_rows = s.num_kv_heads * s.head_dim
        q, k, v = linear(x, w["qkv"]).split([q_rows, kv_rows, kv_rows], dim=-1)
        q = q.reshape(t, s.num_heads, -1)
        gate = None
        if s.attn_output_gate:
            q, gate = q.split(s.head_dim, dim=-1)
        q, k = norm_rope_pair(q, k.reshape(t, s.num_kv_heads, s.head_dim), w["q_norm"], w["k_norm"], s.rms_eps,
                              self.rope, cos, sin, zero_centred=True)
        v = v.reshape(t, s.num_kv_heads, s.head_dim)
        out = segment_attention(q, k, v, segments, slot, positions, self.scale, gate, feeds=w["o"])
        if not isinstance(out, QuantRows):
            out = out.reshape(t, -1)
        return linear(out, w["o"], partial=True)  # into the residual norm

    def _gdn(self, x, w, segments: list[Segment], slot: int):
        s, t = self.geometry, x.shape[0]
        hv, dv = s.linear_num_value_heads, s.linear_value_head_dim
        one = t == 1 and len(segments) == 1 and segments[0][0].kept is None  # one sequence's decode step
        raw, z, b, a = linear(x, w["in_proj"]).split([self.conv_dim, self.value_dim, hv, hv], dim=-1)
        z = z.reshape(t, hv, dv)
        # one sequence's decode step: the GDN kernel applies the output gate too, which saves a norm launch. Not
        # with more rows: the last program's epilogue then costs more than the launch it saves
        gate = output_gate(z, w["norm"], s.rms_eps, x.dtype, segments[0][0].states.recurrent, feeds=w["out"]) \
            if one else None
        outs = []
        for cache, r in segment_rows(segments, t):
            states: GDNState = cache.states
            n = r.stop - r.start
            kept: KeptInputs | None = cache.kept
            if kept is not None:  # a verify step: its inputs are kept, the recurrent state stays until commit
                if n > KEPT_MAX_T:
                    raise ValueError(f"a step that keeps its inputs takes at most {KEPT_MAX_T} tokens, got {n}")
                mixed = conv_step_(raw[r], states.conv[slot], w["conv"], kept.window[slot], kept.inputs[slot])
                out = recurrent_update_(mixed, b[r], a[r], w["neg_a"], w["dt_bias"], self.heads,
                                        states.recurrent[slot], frozen=True, keep_gates=kept.gates[slot])
                outs.append(out)
                continue
            mixed = conv_step_(raw[r], states.conv[slot], w["conv"])
            if n <= RECURRENT_MAX_T:
                out = recurrent_update_(mixed, b[r], a[r], w["neg_a"], w["dt_bias"], self.heads, states.recurrent[slot],
                                        gate=gate)
            else:  # the state in fp32 (the checkpoint's mamba_ssm_dtype); fp64 in oracle runs
                out = chunked_update_(mixed, b[r], a[r], w["a_log"], w["dt_bias"], self.heads, states.recurrent[slot])
            outs.append(out)
        normed = gate.out if gate is not None else \
            gated_rms_norm(joined(outs), z, w["norm"], s.rms_eps, x.dtype, feeds=w["out"])
        return linear(normed, w["out"], partial=True)  # into the residual norm


def attention_layer(weights: dict, prefix: str) -> dict:
    """The tensors of one gated full-attention decoder layer (a target layer, or an MTP layer)."""
    w = {"kind": "full_attention", **{key: weights[prefix + name + ".weight"] for key, name in _COMMON_KEYS.items()}}
    w.update({key: weights[prefix + "self_attn." + name + ".weight"] for key, name in _ATTN_KEYS.items()})
    fuse(w, QKV, "qkv")
    fuse(w, GATE_UP, "gate_up")
    return w


def attention_layer_shapes(s: ModelSpec, prefix: str) -> dict[str, tuple[int, ...]]:
    """Shapes of one gated full-attention decoder layer's tensors under `prefix`."""
    one = replace(s, num_layers=1)
    shapes = {k: v for k, v in common_shapes(one).items() if k.startswith("layers.0.")}
    shapes.update(attention_shapes(one, 0, gated=s.attn_output_gate))
    shapes.update({f"layers.0.self_attn.{n}_norm.weight": (s.head_dim,) for n in "qk"})
    return {prefix + k[len("layers.0."):]: v for k, v in shapes.items()}


def mtp_shapes(s: ModelSpec) -> dict[str, tuple[int, ...]]:
    """The MTP module's tensors (vLLM's Qwen3_5MultiTokenPredictor layout; transformers does not load them)."""
    h = s.hidden_size
    shapes = {"mtp.fc.weight": (h, 2 * h), "mtp.norm.weight": (h,), "mtp.pre_fc_norm_embedding.weight": (h,),
              "mtp.pre_fc_norm_hidden.weight": (h,)}
    for i in range(s.mtp_layers):
        shapes.update(attention_layer_shapes(s, f"mtp.layers.{i}."))
    return shapes


# the projections fused into one weight each: they read the same input
IN_PROJ, QKV, GATE_UP = ("qkv", "z", "b", "a"), ("q", "k", "v"), ("gate", "up")
_COMMON_KEYS = {"in_norm": "input_layernorm", "post_norm": "post_attention_layernorm",
                "gate": "mlp.gate_proj", "up": "mlp.up_proj", "down": "mlp.down_proj"}
_ATTN_KEYS = {"q": "q_proj", "k": "k_proj", "v": "v_proj", "o": "o_proj", "q_norm": "q_norm", "k_norm": "k_norm"}
_GDN_KEYS = {"qkv": "in_proj_qkv", "z": "in_proj_z", "b": "in_proj_b", "a": "in_proj_a", "conv": "conv1d",
             "norm": "norm", "out": "out_proj"}
