"""GGUF loader (llama architecture): metadata -> ModelSpec, tensors dequantized to the model's dtype."""
from __future__ import annotations

import dataclasses
import re
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType

from ..errors import ModelFormatError
from ..models.spec import ModelSpec, RopeSpec
from ..tokenizer.gguf_vocab import tokenizer_from_gguf
from . import LoadedModel
from .gguf_dequant import dequantize
from .gguf_file import GGUFHeader, TensorInfo, qtype_name, read_header, tensor_bytes

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


def _open(path: Path) -> tuple[GGUFHeader, ModelSpec]:
    header = read_header(path)
    by_name = {t.name: t for t in header.tensors}
    if "token_embd.weight" not in by_name:
        raise ModelFormatError(f"{str(path)!r} has no token_embd.weight tensor")
    spec = spec_from_metadata(header.metadata, int(by_name["token_embd.weight"].shape[0]))
    return header, dataclasses.replace(spec, tie_embeddings="output.weight" not in by_name)


def gguf_spec(path: Path) -> ModelSpec:
    """The ModelSpec of a GGUF file, from its metadata and tensor table (the weights are not read)."""
    return _open(path)[1]


def _in_order(pool: ThreadPoolExecutor, fn: Callable, items: Iterable, ahead: int) -> Iterator:
    """fn(item) for each item, run `ahead` at a time in the pool, yielded in order: decoded tensors wait for the
    consumer (a GPU upload, a quantization) in at most `ahead` buffers, not the whole model's."""
    pending: deque = deque()
    for item in items:
        pending.append(pool.submit(fn, item))
        if len(pending) > ahead:
            yield pending.popleft().result()
    while pending:
        yield pending.popleft().result()


def load_gguf(path: Path, dtype: torch.dtype, device: torch.device, transform=None) -> LoadedModel:
    header, spec = _open(path)
    meta = header.metadata
    for t in header.tensors:  # every tensor checked before the slow part starts
        if canonical_name(t.name) is None:
            raise ModelFormatError(f"unexpected tensor {t.name!r} in a {spec.arch} GGUF file")
        if t.qtype not in SUPPORTED_TYPES:
            raise ModelFormatError(
                f"tensor {t.name!r} uses quant type {qtype_name(t.qtype)}, which ninfer does not support",
                hint="supported: " + ", ".join(sorted(q.name for q in SUPPORTED_TYPES)),
            )
    stored = tensor_bytes(path, header)

    def decode(t: TensorInfo) -> np.ndarray:
        w = dequantize(stored[t.name], t.qtype, t.shape)
        if t.name.endswith("attn_q.weight"):
            return _unpermute_qk(w, spec.num_heads)
        if t.name.endswith("attn_k.weight"):
            return _unpermute_qk(w, spec.num_kv_heads)
        return w

    # numpy releases the GIL: the tensors decode on the engine's threads (a few: decoding is bound by memory, and
    # each worker holds a decoded tensor), the tokenizer is built beside them.
    workers = min(torch.get_num_threads(), 4)
    weights: dict[str, torch.Tensor] = {}
    pool = ThreadPoolExecutor(workers)
    try:
        tokenizer = pool.submit(tokenizer_from_gguf, meta)
        for t, w in zip(header.tensors, _in_order(pool, decode, header.tensors, workers), strict=True):
            if tokenizer.done():
                tokenizer.result()  # a vocabulary it cannot build fails the load now, not after every tensor
            name = canonical_name(t.name)
            w = torch.from_numpy(w).to(device=device, dtype=torch.float32 if name == "rope_freqs" else dtype)
            weights[name] = transform(name, w) if transform else w
        return LoadedModel(spec, weights, tokenizer.result(), meta.get("tokenizer.chat_template"), str(path))
    finally:
        # a failed load (a decode, the tokenizer, an upload, Ctrl+C) drops the decodes still queued instead of
        # running them, and waits only for the running ones; a finished load has none queued
        pool.shutdown(wait=True, cancel_futures=True)
