"""GGUF `qwen35` files (llama.cpp's converter for Qwen3.5/3.6 text models): metadata -> ModelSpec, tensor names,
and the converter's conventions undone so the weights are transformers' own:
- every zero-centred RMSNorm weight is stored as 1 + w (all but the GDN output norm, `ssm_norm`);
- `ssm_a` is -exp(A_log), `ssm_dt.bias` is dt_bias, `ssm_conv1d` is the conv kernel without its middle axis;
- with fewer key than value heads, the value heads of each GDN layer are stored tiled (v0 of every key head,
  then v1 of every key head, ...) instead of grouped by key head: the rows of the V part of `attn_qkv`, of
  `attn_gate`, `ssm_beta`, `ssm_alpha`, the V channels of the conv, `ssm_a`/`ssm_dt` and the columns of `ssm_out`;
- the MTP (nextn) layers follow the decoder's blocks: `nextn.*` holds fc and its norms, the rest of the block is
  the MTP decoder layer.
"""
from __future__ import annotations

import re

import numpy as np

from ..errors import ModelFormatError
from ..models.spec import ModelSpec, RopeSpec
from .gguf_meta import MetaReader

_GLOBAL_NAMES = {"token_embd.weight": "embed_tokens.weight", "output_norm.weight": "norm.weight",
                 "output.weight": "lm_head.weight"}
_LAYER_NAMES = {"attn_norm.weight": "input_layernorm.weight",
                "post_attention_norm.weight": "post_attention_layernorm.weight",
                "ffn_gate.weight": "mlp.gate_proj.weight", "ffn_up.weight": "mlp.up_proj.weight",
                "ffn_down.weight": "mlp.down_proj.weight"}
_ATTENTION_NAMES = {"attn_q.weight": "self_attn.q_proj.weight", "attn_k.weight": "self_attn.k_proj.weight",
                    "attn_v.weight": "self_attn.v_proj.weight", "attn_output.weight": "self_attn.o_proj.weight",
                    "attn_q_norm.weight": "self_attn.q_norm.weight", "attn_k_norm.weight": "self_attn.k_norm.weight"}
_GDN_NAMES = {"attn_qkv.weight": "linear_attn.in_proj_qkv.weight", "attn_gate.weight": "linear_attn.in_proj_z.weight",
              "ssm_beta.weight": "linear_attn.in_proj_b.weight", "ssm_alpha.weight": "linear_attn.in_proj_a.weight",
              "ssm_conv1d.weight": "linear_attn.conv1d.weight", "ssm_a": "linear_attn.A_log",
              "ssm_dt.bias": "linear_attn.dt_bias", "ssm_norm.weight": "linear_attn.norm.weight",
              "ssm_out.weight": "linear_attn.out_proj.weight"}
_NEXTN_NAMES = {"nextn.eh_proj.weight": "mtp.fc.weight", "nextn.enorm.weight": "mtp.pre_fc_norm_embedding.weight",
                "nextn.hnorm.weight": "mtp.pre_fc_norm_hidden.weight",
                "nextn.shared_head_norm.weight": "mtp.norm.weight"}
_BLOCK_RE = re.compile(r"^blk\.(\d+)\.(.+)$")


def spec_from_metadata(meta: dict, n_vocab_tensor: int) -> ModelSpec:
    get = MetaReader(meta, "qwen35")
    hidden, heads = int(get("embedding_length")), int(get("attention.head_count"))
    head_dim = int(get("attention.key_length", hidden // heads))
    if int(get("attention.value_length", head_dim)) != head_dim:
        raise ModelFormatError("qwen35 GGUF: attention key and value head sizes differ, which Qwen3.5 never has")
    scaling = get("rope.scaling.type", "none")
    if scaling != "none":
        raise ModelFormatError(f"unsupported RoPE scaling type {scaling!r} in a qwen35 GGUF file")
    mtp_layers = int(get("nextn_predict_layers", 0))
    layers = int(get("block_count")) - mtp_layers
    value_heads = int(get("ssm.time_step_rank"))
    inner = int(get("ssm.inner_size"))
    if value_heads <= 0 or inner % value_heads or layers <= 0:
        raise ModelFormatError(f"qwen35 GGUF: inconsistent geometry (ssm.inner_size {inner}, ssm.time_step_rank "
                               f"{value_heads}, {layers} decoder layers)")
    recurrent = get("attention.recurrent_layers", None)
    if recurrent is not None:
        if len(recurrent) < layers:
            raise ModelFormatError(f"qwen35 GGUF: attention.recurrent_layers lists {len(recurrent)} layers, the "
                                   f"model has {layers}")
        kinds = tuple("linear_attention" if r else "full_attention" for r in recurrent[:layers])
    else:
        interval = int(get("full_attention_interval", 4))
        kinds = tuple("full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(layers))
    # NeoX RoPE over the first `rope.dimension_count` dims of each head. Text positions are one index for all
    # three MRoPE sections (`rope.dimension_sections`, time/row/column and a fourth unused); an image's tokens turn
    # each section by their own coordinate (with a vision projector, `gguf_mmproj`).
    sections = [int(x) for x in get("rope.dimension_sections", (11, 11, 10, 0))[:3]]
    rope = RopeSpec(theta=float(get("rope.freq_base", 10000000.0)), rotary_dim=int(get("rope.dimension_count")),
                    mrope_section=tuple(sections))
    return ModelSpec(
        arch="qwen3_5", vocab_size=int(get("vocab_size", n_vocab_tensor)), hidden_size=hidden, num_layers=layers,
        num_heads=heads, num_kv_heads=int(get("attention.head_count_kv", heads)), head_dim=head_dim,
        intermediate_size=int(get("feed_forward_length")), rms_eps=float(get("attention.layer_norm_rms_epsilon")),
        rope=rope, tie_embeddings=False, max_position=int(get("context_length", 262144)), layer_types=kinds,
        attn_output_gate=True,  # llama.cpp's qwen35 graph always gates: its attn_q holds [query | gate] per head
        linear_num_key_heads=int(get("ssm.group_count")), linear_num_value_heads=value_heads,
        linear_key_head_dim=int(get("ssm.state_size")), linear_value_head_dim=inner // value_heads,
        linear_conv_kernel=int(get("ssm.conv_kernel")), mtp_layers=mtp_layers, **get.special_tokens(),
    )


def canonical_name(gguf_name: str, spec: ModelSpec) -> str | None:
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    m = _BLOCK_RE.match(gguf_name)
    if not m:
        return None
    block, rest = int(m.group(1)), m.group(2)
    if block >= spec.num_layers + spec.mtp_layers:
        return None
    if block >= spec.num_layers:  # an MTP layer
        if rest in _NEXTN_NAMES:
            return _NEXTN_NAMES[rest] if block == spec.num_layers else None
        name = _LAYER_NAMES.get(rest) or _ATTENTION_NAMES.get(rest)
        return None if name is None else f"mtp.layers.{block - spec.num_layers}.{name}"
    own = _ATTENTION_NAMES if spec.kinds()[block] == "full_attention" else _GDN_NAMES
    name = _LAYER_NAMES.get(rest) or own.get(rest)
    return None if name is None else f"layers.{block}.{name}"


def _zero_centred_norm(canonical: str) -> bool:
    return canonical.endswith("norm.weight") and not canonical.endswith("linear_attn.norm.weight") \
        or canonical.startswith("mtp.pre_fc_norm")


def _value_heads_grouped(spec: ModelSpec, head_size: int) -> np.ndarray | None:
    """Stored (tiled) indices of the value heads' rows in grouped order; None when there is one value head per
    key head (nothing was reordered)."""
    keys, values = spec.linear_num_key_heads, spec.linear_num_value_heads
    if keys == values:
        return None
    per_key = values // keys
    return np.arange(values * head_size).reshape(per_key, keys, head_size).swapaxes(0, 1).reshape(-1)


# GDN tensors whose rows run over the value heads: the rows each head has (the conv and `attn_qkv` keep their q
# and k rows first, in place)
_VALUE_HEAD_ROWS = {"attn_gate.weight": "value_head_dim", "attn_qkv.weight": "value_head_dim",
                    "ssm_conv1d.weight": "value_head_dim", "ssm_beta.weight": 1, "ssm_alpha.weight": 1, "ssm_a": 1,
                    "ssm_dt.bias": 1}


def row_order(gguf_name: str, spec: ModelSpec, rows: int) -> np.ndarray | None:
    """The stored rows to take, in order, for the canonical tensor (None: as stored)."""
    m = _BLOCK_RE.match(gguf_name)
    per_head = _VALUE_HEAD_ROWS.get(m.group(2)) if m else None
    if per_head is None:
        return None
    order = _value_heads_grouped(spec, spec.linear_value_head_dim if per_head == "value_head_dim" else 1)
    if order is None:
        return None
    return np.concatenate([np.arange(rows - len(order)), rows - len(order) + order])


def keeps_values(gguf_name: str, spec: ModelSpec) -> bool:
    """Whether the canonical tensor holds the stored values unchanged, rows reordered at most (so its quantized
    blocks can be kept as they are): not the norms stored as 1 + w, the decay rates, the conv kernel, nor
    `ssm_out` when its columns (the value heads) were reordered."""
    name = canonical_name(gguf_name, spec) or ""
    if _zero_centred_norm(name) or name.endswith(("A_log", "conv1d.weight")):
        return False
    return not (name.endswith("out_proj.weight") and _value_heads_grouped(spec, 1) is not None)


def convert(gguf_name: str, spec: ModelSpec, w: np.ndarray) -> np.ndarray:
    """A dequantized (float32) tensor in transformers' layout and conventions."""
    name = canonical_name(gguf_name, spec) or ""
    order = row_order(gguf_name, spec, w.shape[0])
    if order is not None:
        w = w[order]
    if name.endswith("out_proj.weight"):
        cols = _value_heads_grouped(spec, spec.linear_value_head_dim)
        if cols is not None:
            w = w[:, cols]
    if _zero_centred_norm(name):
        # exact where the stored 1 + w lies in [0.5, 2] (Sterbenz), so the model's 1 + w is the stored value
        return w - np.float32(1)
    if name.endswith("A_log"):
        return np.log(-w)  # ssm_a = -exp(A_log)
    if name.endswith("conv1d.weight"):
        return np.ascontiguousarray(w).reshape(w.shape[0], 1, -1)
    return w
