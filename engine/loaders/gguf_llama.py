"""GGUF `llama` files: metadata -> ModelSpec, tensor names, and the converter's q/k row interleave undone."""
from __future__ import annotations

import re

import numpy as np

from ..errors import ModelFormatError
from ..models.spec import ModelSpec, RopeSpec
from .gguf_meta import MetaReader

_GLOBAL_NAMES = {
    "token_embd.weight": "embed_tokens.weight",
    "output_norm.weight": "norm.weight",
    "output.weight": "lm_head.weight",
    "rope_freqs.weight": "rope_freqs",
}
_BLOCK_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_BLOCK_RE = re.compile(r"^blk\.(\d+)\.([a-z_]+)\.(weight|bias)$")


def spec_from_metadata(meta: dict, n_vocab_tensor: int) -> ModelSpec:
    get = MetaReader(meta, "llama")
    hidden = int(get("embedding_length"))
    heads = int(get("attention.head_count"))
    head_dim = int(get("attention.key_length", hidden // heads))
    scaling = get("rope.scaling.type", "none")
    if scaling not in ("none", "linear"):
        raise ModelFormatError(f"unsupported RoPE scaling type {scaling!r} in GGUF metadata")
    rope = RopeSpec(
        theta=float(get("rope.freq_base", 10000.0)),
        rotary_dim=int(get("rope.dimension_count", head_dim)),
        scaling_type="linear" if scaling == "linear" else None,
        factor=float(get("rope.scaling.factor", 1.0)),
    )
    return ModelSpec(
        arch="llama",
        vocab_size=int(get("vocab_size", n_vocab_tensor)),
        hidden_size=hidden,
        num_layers=int(get("block_count")),
        num_heads=heads,
        num_kv_heads=int(get("attention.head_count_kv", heads)),
        head_dim=head_dim,
        intermediate_size=int(get("feed_forward_length")),
        rms_eps=float(get("attention.layer_norm_rms_epsilon", 1e-5)),
        rope=rope,
        tie_embeddings=False,  # decided once the tensors are known
        max_position=int(get("context_length", 4096)),
        **get.special_tokens(),
    )


def canonical_name(gguf_name: str, spec: ModelSpec) -> str | None:
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    m = _BLOCK_RE.match(gguf_name)
    if m and m.group(2) in _BLOCK_NAMES:
        return f"layers.{m.group(1)}.{_BLOCK_NAMES[m.group(2)]}.{m.group(3)}"
    return None


def _interleaved_halves(rows: int, n_head: int) -> np.ndarray:
    """The row order that undoes llama.cpp's converter, which interleaves the two rotary halves of each q/k head:
    the weights come back in HF's rotate-half layout, so one RoPE implementation serves every loader."""
    half = rows // n_head // 2
    return np.arange(rows).reshape(n_head, half, 2).swapaxes(2, 1).reshape(rows)


def row_order(gguf_name: str, spec: ModelSpec, rows: int) -> np.ndarray | None:
    """The stored rows to take, in order, for the canonical tensor (None: as stored)."""
    if gguf_name.endswith("attn_q.weight"):
        return _interleaved_halves(rows, spec.num_heads)
    if gguf_name.endswith("attn_k.weight"):
        return _interleaved_halves(rows, spec.num_kv_heads)
    return None


def convert(gguf_name: str, spec: ModelSpec, w: np.ndarray) -> np.ndarray:
    """A dequantized tensor in the canonical layout (the llama converter changes nothing but the row order)."""
    order = row_order(gguf_name, spec, w.shape[0])
    return w if order is None else w[order]


def keeps_values(gguf_name: str, spec: ModelSpec) -> bool:
    """Whether the canonical tensor holds the stored values unchanged, rows reordered at most (so its quantized
    blocks can be kept as they are)."""
    return True
