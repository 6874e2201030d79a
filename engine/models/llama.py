"""Llama-family decoder (RMSNorm, RoPE, GQA, SwiGLU), reference path in plain torch."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ..cache.kv_cache import KVCache
from ..cache.sequence import SequenceCache
from ..errors import ModelFormatError
from .layers import Rope, causal_attention, rms_norm, swiglu
from .spec import ModelSpec


def require(weights: dict[str, torch.Tensor], name: str, shape: tuple[int, ...]) -> torch.Tensor:
    """The named weight, checked against the shape the spec implies."""
    if name not in weights:
        raise ModelFormatError(f"model weights lack tensor {name!r}")
    w = weights[name]
    if tuple(w.shape) != shape:
        raise ModelFormatError(f"tensor {name!r} has shape {tuple(w.shape)}, the config implies {shape}")
    return w


class LlamaModel:
    def __init__(self, spec: ModelSpec, weights: dict[str, torch.Tensor], kv_dtype: str = "auto") -> None:
        self.spec = spec
        self.kv_dtype = kv_dtype
        s = spec
        h, qd, kd = s.hidden_size, s.num_heads * s.head_dim, s.num_kv_heads * s.head_dim
        self.embed = require(weights, "embed_tokens.weight", (s.vocab_size, h))
        self.device, self.dtype = self.embed.device, self.embed.dtype
        self.lm_head = self.embed if s.tie_embeddings else require(weights, "lm_head.weight", (s.vocab_size, h))
        self.norm = require(weights, "norm.weight", (h,))
        self.layers = []
        for i in range(s.num_layers):
            p = f"layers.{i}."
            self.layers.append({
                "in_norm": require(weights, p + "input_layernorm.weight", (h,)),
                "q": require(weights, p + "self_attn.q_proj.weight", (qd, h)),
                "k": require(weights, p + "self_attn.k_proj.weight", (kd, h)),
                "v": require(weights, p + "self_attn.v_proj.weight", (kd, h)),
                "o": require(weights, p + "self_attn.o_proj.weight", (h, qd)),
                "post_norm": require(weights, p + "post_attention_layernorm.weight", (h,)),
                "gate": require(weights, p + "mlp.gate_proj.weight", (s.intermediate_size, h)),
                "up": require(weights, p + "mlp.up_proj.weight", (s.intermediate_size, h)),
                "down": require(weights, p + "mlp.down_proj.weight", (h, s.intermediate_size)),
            })
        self.rope = Rope(s.rope, s.head_dim, self.device, weights.get("rope_freqs"))
        self.scale = s.head_dim ** -0.5

    def new_cache(self, max_len: int) -> SequenceCache:
        s = self.spec
        kv = KVCache(s.num_layers, max_len, s.num_kv_heads, s.head_dim, self.kv_dtype, self.dtype, self.device)
        return SequenceCache(kv=kv)

    def forward(self, ids: torch.Tensor, cache: SequenceCache, all_logits: bool = False) -> torch.Tensor:
        """Run T new tokens after `cache.length` cached ones; returns logits [T or 1, vocab] in fp32."""
        s, start, t = self.spec, cache.length, ids.shape[0]
        positions = torch.arange(start, start + t, device=self.device)
        cos, sin = self.rope.cos_sin(positions, self.dtype)
        x = F.embedding(ids, self.embed)
        for i, w in enumerate(self.layers):
            a = rms_norm(x, w["in_norm"], s.rms_eps)
            q = self.rope.apply(F.linear(a, w["q"]).view(t, s.num_heads, s.head_dim), cos, sin)
            k = self.rope.apply(F.linear(a, w["k"]).view(t, s.num_kv_heads, s.head_dim), cos, sin)
            v = F.linear(a, w["v"]).view(t, s.num_kv_heads, s.head_dim)
            cache.kv.write(i, start, k, v)
            keys, values = cache.kv.read(i, start + t)
            attn = causal_attention(q, keys, values, start, self.scale)
            x = x + F.linear(attn.reshape(t, -1), w["o"])
            x = x + swiglu(rms_norm(x, w["post_norm"], s.rms_eps), w["gate"], w["up"], w["down"])
        cache.length = start + t
        if not all_logits:
            x = x[-1:]
        return F.linear(rms_norm(x, self.norm, s.rms_eps), self.lm_head).float()
