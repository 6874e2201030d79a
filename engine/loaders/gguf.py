"""GGUF loader (llama architecture): metadata -> ModelSpec, tensors dequantized with the `gguf` package."""
from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFReader
from gguf.quants import dequantize

from ..errors import ModelFormatError
from ..models.spec import ModelSpec, RopeSpec
from ..tokenizer.gguf_vocab import tokenizer_from_gguf
from . import LoadedModel

SUPPORTED_TYPES = {
    GGMLQuantizationType.F32, GGMLQuantizationType.F16, GGMLQuantizationType.BF16,
    GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q4_1, GGMLQuantizationType.Q8_0,
    GGMLQuantizationType.Q4_K, GGMLQuantizationType.Q5_K, GGMLQuantizationType.Q6_K,
}
SUPPORTED_ARCHS = ("llama",)

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


def read_metadata(reader: GGUFReader) -> dict:
    meta = {}
    for key, fld in reader.fields.items():
        if key.startswith("GGUF."):
            continue
        try:
            meta[key] = fld.contents()
        except Exception as exc:  # a field type the gguf package cannot decode
            raise ModelFormatError(f"GGUF metadata key {key!r} cannot be read: {exc}") from None
    return meta


def spec_from_metadata(meta: dict, n_vocab_tensor: int) -> ModelSpec:
    arch = meta.get("general.architecture")
    if arch not in SUPPORTED_ARCHS:
        raise ModelFormatError(
            f"unsupported GGUF architecture {arch!r}",
            hint=f"supported GGUF architectures: {', '.join(SUPPORTED_ARCHS)}",
        )

    def get(key: str, default=None):
        full = f"{arch}.{key}"
        if full not in meta and default is None:
            raise ModelFormatError(f"GGUF metadata lacks {full!r}")
        return meta.get(full, default)

    hidden = int(get("embedding_length"))
    heads = int(get("attention.head_count"))
    head_dim = int(meta.get(f"{arch}.attention.key_length", hidden // heads))
    scaling = meta.get(f"{arch}.rope.scaling.type")
    rope = RopeSpec(
        theta=float(get("rope.freq_base", 10000.0)),
        rotary_dim=int(meta.get(f"{arch}.rope.dimension_count", head_dim)),
        scaling_type=scaling if scaling in ("linear",) else None,
        factor=float(meta.get(f"{arch}.rope.scaling.factor", 1.0)),
    )
    if scaling not in (None, "none", "linear"):
        raise ModelFormatError(f"unsupported RoPE scaling type {scaling!r} in GGUF metadata")
    eos = meta.get("tokenizer.ggml.eos_token_id")
    bos = meta.get("tokenizer.ggml.bos_token_id")
    return ModelSpec(
        arch="llama",
        vocab_size=int(meta.get(f"{arch}.vocab_size", n_vocab_tensor)),
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
        bos_token_id=None if bos is None else int(bos),
        eos_token_ids=() if eos is None else (int(eos),),
    )


def _unpermute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    # llama.cpp's converter interleaves the two rotary halves of each q/k head; undo it so the
    # weights are in HF's rotate-half layout and one RoPE implementation serves every loader.
    half = w.shape[0] // n_head // 2
    return w.reshape(n_head, half, 2, *w.shape[1:]).swapaxes(2, 1).reshape(w.shape)


def canonical_name(gguf_name: str) -> str | None:
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    m = _BLOCK_RE.match(gguf_name)
    if m and m.group(2) in _BLOCK_NAMES:
        return f"layers.{m.group(1)}.{_BLOCK_NAMES[m.group(2)]}.{m.group(3)}"
    return None


def _open(path: Path) -> tuple[GGUFReader, dict, ModelSpec]:
    try:
        reader = GGUFReader(str(path))
    except Exception as exc:
        raise ModelFormatError(f"{str(path)!r} is not a readable GGUF file: {exc}") from None
    meta = read_metadata(reader)
    by_name = {t.name: t for t in reader.tensors}
    if "token_embd.weight" not in by_name:
        raise ModelFormatError(f"{str(path)!r} has no token_embd.weight tensor")
    spec = spec_from_metadata(meta, int(by_name["token_embd.weight"].shape[-1]))
    return reader, meta, dataclasses.replace(spec, tie_embeddings="output.weight" not in by_name)


def gguf_spec(path: Path) -> ModelSpec:
    """The ModelSpec of a GGUF file, from its metadata and tensor names (the file is memory-mapped, not read)."""
    return _open(path)[2]


def load_gguf(path: Path, dtype: torch.dtype, device: torch.device, transform=None) -> LoadedModel:
    reader, meta, spec = _open(path)
    weights: dict[str, torch.Tensor] = {}
    for t in reader.tensors:
        name = canonical_name(t.name)
        if name is None:
            raise ModelFormatError(f"unexpected tensor {t.name!r} in a {spec.arch} GGUF file")
        if t.tensor_type not in SUPPORTED_TYPES:
            raise ModelFormatError(
                f"tensor {t.name!r} uses quant type {t.tensor_type.name}, which ninfer does not support",
                hint="supported: " + ", ".join(sorted(q.name for q in SUPPORTED_TYPES)),
            )
        shape = tuple(int(d) for d in reversed(t.shape))  # ggml lists the fastest dimension first
        arr = np.array(dequantize(t.data, t.tensor_type), dtype=np.float32).reshape(shape)
        if t.name.endswith("attn_q.weight"):
            arr = _unpermute_qk(arr, spec.num_heads)
        elif t.name.endswith("attn_k.weight"):
            arr = _unpermute_qk(arr, spec.num_kv_heads)
        keep = torch.float32 if name == "rope_freqs" else dtype
        t = torch.from_numpy(arr).to(device=device, dtype=keep)
        weights[name] = transform(name, t) if transform else t
    tokenizer = tokenizer_from_gguf(meta)
    return LoadedModel(spec, weights, tokenizer, meta.get("tokenizer.chat_template"), str(path))
