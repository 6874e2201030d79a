"""GGUF loader (llama and qwen35 architectures): metadata -> ModelSpec, tensors dequantized to the model's dtype, or
kept in the file's quantized blocks where the device's kernels read them (the CPU's C kernels, a GPU's Triton
ones); a qwen35 model's vision tower from its projector file (`gguf_mmproj`)."""
from __future__ import annotations

import dataclasses
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType

from ..errors import ModelFormatError
from ..models.spec import ModelSpec
from ..quant.gguf_blocks import BLOCK_TYPES, from_blocks, kept_types
from ..tokenizer.gguf_vocab import tokenizer_from_gguf
from . import LoadedModel, VisionConfig, gguf_llama, gguf_mmproj, gguf_qwen35
from .gguf_dequant import dequantize
from .gguf_file import GGUFHeader, TensorInfo, qtype_name, read_header, tensor_bytes

# Q5_0/Q5_1 are what llama.cpp's K-quant mixes fall back to for rows that are not whole super-blocks
SUPPORTED_TYPES = {
    GGMLQuantizationType.F32, GGMLQuantizationType.F16, GGMLQuantizationType.BF16,
    GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q4_1, GGMLQuantizationType.Q5_0, GGMLQuantizationType.Q5_1,
    GGMLQuantizationType.Q8_0, GGMLQuantizationType.Q4_K, GGMLQuantizationType.Q5_K, GGMLQuantizationType.Q6_K,
    GGMLQuantizationType.IQ4_XS,
}
# llama.cpp's architecture names -> the module that reads its files (spec_from_metadata, canonical_name,
# row_order, keeps_values, convert)
ARCHS = {"llama": gguf_llama, "qwen35": gguf_qwen35}


def _kept_dtype(name: str, dtype: torch.dtype) -> torch.dtype:
    """RoPE frequency factors and the GDN decay parameters stay in fp32 (or better) whatever the compute dtype:
    exp(A_log) in bf16 would lose the decay rates' precision."""
    return torch.promote_types(dtype, torch.float32) if name.endswith(("rope_freqs", "A_log", "dt_bias")) else dtype


def _kept(device: torch.device, transform) -> tuple[int, ...]:
    """The quantized types that stay in the file's blocks: those the device's kernels read, unless the profile asks
    for other formats (`transform`: every tensor is then dequantized and re-quantized to them)."""
    return () if transform is not None else kept_types(device)


def keeps_blocks(t: TensorInfo, kept: tuple[int, ...], arch, spec: ModelSpec) -> bool:
    """Whether tensor t loads as its stored blocks: a matrix of a kept type whose values the model takes as
    stored (rows reordered at most)."""
    return t.qtype in kept and len(t.shape) == 2 and arch.keeps_values(t.name, spec)


def kept_bytes(path: Path, device: torch.device) -> dict[str, int]:
    """The stored bytes of each tensor (by canonical name) that a load on `device` keeps in its blocks when the
    profile asks for no other format: the memory plan counts these, not the compute dtype's."""
    header, spec, _ = _open(path)
    arch = arch_of(header.metadata)
    kept = kept_types(device)
    return {arch.canonical_name(t.name, spec): t.nbytes for t in header.tensors if keeps_blocks(t, kept, arch, spec)}


def arch_of(meta: dict):
    arch = meta.get("general.architecture")
    if arch == "clip":
        raise ModelFormatError("this GGUF file is a vision projector (mmproj), not a model",
                               hint="give the model's GGUF file as the model, and this one as --mmproj")
    if arch not in ARCHS:
        raise ModelFormatError(f"unsupported GGUF architecture {arch!r}",
                               hint=f"supported GGUF architectures: {', '.join(ARCHS)}")
    return ARCHS[arch]


def _open(path: Path, vision: bool = False,
          mmproj: str = "") -> tuple[GGUFHeader, ModelSpec, tuple[Path, VisionConfig] | None]:
    """The file's header and geometry, and with `vision` its projector file and vision config (`mmproj`: the
    setting, empty = the one beside the file) or None (text only)."""
    header = read_header(path)
    arch = arch_of(header.metadata)
    by_name = {t.name: t for t in header.tensors}
    if "token_embd.weight" not in by_name:
        raise ModelFormatError(f"{str(path)!r} has no token_embd.weight tensor")
    spec = arch.spec_from_metadata(header.metadata, int(by_name["token_embd.weight"].shape[0]))
    spec = dataclasses.replace(spec, tie_embeddings="output.weight" not in by_name)
    projector = gguf_mmproj.find_mmproj(path, mmproj, header.metadata) if vision else None
    if projector is None:
        return header, spec, None
    config, tower = gguf_mmproj.projector_config(projector, spec, header.metadata)
    return header, gguf_mmproj.with_tower(spec, tower), (projector, config)


def gguf_spec(path: Path, vision: bool = False, mmproj: str = "") -> ModelSpec:
    """The ModelSpec of a GGUF file, from its metadata and tensor table (the weights are not read); with `vision`,
    its projector file's tower counted."""
    return _open(path, vision, mmproj)[1]


def projector_file(path: Path, mmproj: str = "") -> Path | None:
    """The vision projector file a GGUF model loads with (`mmproj`, or the one beside it), checked against the
    model; None: the model runs text only."""
    projector = _open(path, True, mmproj)[2]
    return None if projector is None else projector[0]


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


def load_gguf(path: Path, dtype: torch.dtype, device: torch.device, transform=None,
              blocks: bool | None = None, vision: bool = False, mmproj: str = "") -> LoadedModel:
    """`blocks`: keep the quantized tensors in the file's blocks (None: those of the types the device's kernels
    read, where no `transform` asks for another format; `ninfer convert` keeps every type the CPU kernels read,
    whatever the machine it runs on). `vision`: load the vision tower of its projector file (`mmproj`, or the one
    beside it) where there is one."""
    header, spec, projector = _open(path, vision, mmproj)
    meta = header.metadata
    arch = arch_of(meta)
    names = {}
    for t in header.tensors:  # every tensor checked before the slow part starts
        names[t.name] = arch.canonical_name(t.name, spec)
        if names[t.name] is None:
            raise ModelFormatError(f"unexpected tensor {t.name!r} in a {meta['general.architecture']} GGUF file",
                                   hint="the file was written by a converter ninfer does not know; convert the "
                                   "model again with llama.cpp's convert_hf_to_gguf.py")
        if t.qtype not in SUPPORTED_TYPES:
            raise ModelFormatError(
                f"tensor {t.name!r} uses quant type {qtype_name(t.qtype)}, which ninfer does not support",
                hint="supported: " + ", ".join(sorted(q.name for q in SUPPORTED_TYPES)),
            )
    stored = tensor_bytes(path, header)
    kept = _kept(device, transform) if blocks is None else BLOCK_TYPES if blocks else ()

    def decode(t: TensorInfo) -> np.ndarray:
        if keeps_blocks(t, kept, arch, spec):
            rows = stored[t.name].reshape(t.shape[0], -1)
            order = arch.row_order(t.name, spec, t.shape[0])
            return rows.copy() if order is None else rows[order]  # a copy: the model outlives the mapped file
        return arch.convert(t.name, spec, dequantize(stored[t.name], t.qtype, t.shape))

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
            name = names[t.name]
            if w.dtype == np.uint8:  # the file's blocks
                weights[name] = from_blocks(t.qtype, torch.from_numpy(w).to(device), t.shape[-1], dtype)
                continue
            w = torch.from_numpy(w).to(device=device, dtype=_kept_dtype(name, dtype))
            weights[name] = transform(name, w) if transform else w
        if projector is not None:  # the tower in the compute dtype whatever the formats, as a folder's
            weights.update(gguf_mmproj.load_tower(projector[0], dtype, device))
        return LoadedModel(spec, weights, tokenizer.result(), meta.get("tokenizer.chat_template"), str(path),
                           None if projector is None else projector[1])
    finally:
        # a failed load (a decode, the tokenizer, an upload, Ctrl+C) drops the decodes still queued instead of
        # running them, and waits only for the running ones; a finished load has none queued
        pool.shutdown(wait=True, cancel_futures=True)
