"""Loading a converted model folder (`ninfer convert`; the manifest is `manifest.py`): the shards are mapped, each
one's SHA-256 checked as its bytes are read, and the tensors taken as they are: nothing is quantized.

Shards hold whole weights: a plain tensor under its canonical name; a q8/q5/q4 weight as `NAME.codes`,
`NAME.scales` (and q5's `NAME.high`) in the row-major layout `quantize` returns (the tiled layout is a permutation
made here where the CUDA kernels run it); a GGUF weight kept in its file's blocks as `NAME.blocks.I`, one uint8
[rows, bytes per row] tensor per run of one type (kept where the device's kernels read the type, elsewhere
dequantized here, as the GGUF loader does). Besides the weights the folder carries a HF source's config.json,
tokenizer and template files as they were, or a GGUF source's metadata as a GGUF file without tensors (and its
vision projector's, the tower in the shards): read as the loaders read those.

Every load checks each shard's size, and its SHA-256 while the bytes are read: a worker per shard (up to 8) maps and
hashes it ahead of the thread that takes its tensors, so the hash costs CPU time beside the read rather than a
second read (SHA-256 runs at ~1.5 GB/s a core with the SHA extensions). A shard hashed once is not hashed again
while its file stays as it was (`verified_shards.py`). On a GPU the tensors go through pinned staging buffers
(`staging.py`); on the CPU they are the mapped views themselves.
"""
from __future__ import annotations

import hashlib
import json
import mmap
import os
import time
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import torch

from ..config import EngineConfig, WeightFormats
from ..errors import ModelFormatError, UserError
from ..models.spec import ModelSpec, spec_from_hf_config
from ..quant.gguf_blocks import BlockRows, GGUFWeight, kept_types
from ..quant.qweight import GROUP, QuantizedWeight, prefer_tiles
from . import VISION_PREFIX, LoadedModel, VisionConfig, hf_config, model_kind
from .manifest import GGUF_METADATA, MMPROJ_METADATA, FileEntry, Manifest, TensorEntry, convert_again, read_manifest
from .staging import StagedCopies
from .verified_shards import FileState, VerifiedShards

# safetensors' dtype names -> torch's, for the dtypes a converted folder stores
_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
           "I8": torch.int8, "U8": torch.uint8}
_MAX_WORKERS = 8


def settled_config(config: EngineConfig) -> EngineConfig:
    """The config with a converted folder's weight formats: a profile that leaves every format "auto" takes the
    folder's (so the memory plan and the disk tier count what is loaded); one that names other formats is refused
    rather than quantized a second time. Other models' configs are returned as they are."""
    if model_kind(config.model) != "converted":
        return config
    folder = Path(config.model).expanduser()
    m = read_manifest(folder)
    asked = config.weights.as_dict()
    if all(v == "auto" for v in asked.values()):
        return replace(config, weights=WeightFormats(**m.weights))
    if asked != m.weights:
        uniform = len(set(asked.values())) == 1
        wanted = f"--weights {asked['attn']}" if uniform else " ".join(f"--set weights.{k}={v}"
                                                                      for k, v in asked.items())
        raise UserError(f"{folder} holds weights converted to {m.formats_text()}; the profile asks for "
                        + ", ".join(f"{k} {v}" for k, v in asked.items()),
                        hint=f"load it with --weights auto (its own formats), or convert it again with the formats "
                        f"asked: ninfer convert {m.source} {folder} {wanted} --force")
    return config


def converted_spec(folder: Path) -> ModelSpec:
    return _spec(folder, read_manifest(folder))


def kept_bytes(folder: Path, device: torch.device) -> dict[str, int]:
    """The stored bytes of each GGUF weight (by canonical name) that a load on `device` keeps in its blocks: the
    memory plan counts these, as it does a GGUF file's (`gguf.kept_bytes`). A weight of several runs of rows, which
    the manifest does not split, counts at its widest type's bytes per row (never short); `ninfer convert` writes
    one run per weight."""
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    kept = kept_types(device)
    out = {}
    for name, e in read_manifest(folder).tensors.items():
        if e.format == "gguf" and e.qtypes and all(q in kept for q in e.qtypes):
            sizes = [GGML_QUANT_SIZES[GGMLQuantizationType(q)] for q in e.qtypes]
            out[name] = e.shape[0] * max(e.shape[1] // block * size for block, size in sizes)
    return out


def _gguf_metadata(folder: Path, name: str = GGUF_METADATA) -> dict:
    from .gguf_file import read_header

    return read_header(folder / name).metadata


def _projector(folder: Path, m: Manifest, text: ModelSpec) -> tuple[VisionConfig, dict] | None:
    """A GGUF source's vision projector converted with it, read as the GGUF loader reads the file: its metadata,
    with the sizes the loader takes from its tensor table from the tower's entries; None: text only."""
    if not any(name.startswith(VISION_PREFIX) for name in m.tensors):
        return None
    patch, positions = (VISION_PREFIX + n for n in ("patch_embed.proj.weight", "pos_embed.weight"))
    lacks = [n for n in (patch, positions) if n not in m.tensors]
    if not (folder / MMPROJ_METADATA).is_file() or lacks:
        raise ModelFormatError(f"{folder}: its vision tower lacks {lacks[0] if lacks else MMPROJ_METADATA}",
                               hint=convert_again(folder, m.source, m.mmproj))
    from .gguf_mmproj import kept_projector_config

    return kept_projector_config(f"{folder.name}/{MMPROJ_METADATA}", _gguf_metadata(folder, MMPROJ_METADATA),
                                 m.tensors[patch].shape[1], m.tensors[positions].shape[0], text,
                                 _gguf_metadata(folder))


def _spec(folder: Path, m: Manifest) -> ModelSpec:
    """The source's geometry, read as its own loader reads it: a GGUF's metadata, with what the GGUF loader takes
    from the tensor table (the vocabulary rows, whether there is an output matrix) from the manifest, and its
    projector's tower; or the copied config.json (a vision_config without a converted tower is a text-only
    model)."""
    if "embed_tokens.weight" not in m.tensors:
        raise ModelFormatError(f"{folder}: the manifest lists no embed_tokens.weight", hint=convert_again(folder))
    if m.source_kind == "gguf":
        from .gguf import arch_of
        from .gguf_mmproj import with_tower

        meta = _gguf_metadata(folder)
        spec = arch_of(meta).spec_from_metadata(meta, m.tensors["embed_tokens.weight"].shape[0])
        spec = replace(spec, tie_embeddings="lm_head.weight" not in m.tensors)
        projector = _projector(folder, m, spec)
        return spec if projector is None else with_tower(spec, projector[1])
    spec = spec_from_hf_config(hf_config(folder))
    if spec.vision_params and not any(name.startswith(VISION_PREFIX) for name in m.tensors):
        spec = replace(spec, vision_params=0)
    return spec


def _check_sizes(folder: Path, m: Manifest) -> None:
    for s in m.shards:
        path = folder / s.name
        size = path.stat().st_size if path.is_file() else None
        if size != s.bytes:
            found = "is missing" if size is None else f"has {size} bytes, the manifest says {s.bytes}"
            raise ModelFormatError(f"{folder}: shard {s.name} {found}",
                                   hint="copy the whole folder again, or " + convert_again(folder, m.source, m.mmproj))


@dataclass
class _Shard:
    name: str
    tensors: dict[str, torch.Tensor]  # views of the shard's mapping


def _sha256(buf: mmap.mmap) -> str:
    return hashlib.sha256(buf).hexdigest()


def _verify(folder: Path, m: Manifest, entry: FileEntry, buf: mmap.mmap, fd: int, record: VerifiedShards | None,
            before: FileState) -> None:
    """Refuse a shard whose bytes do not match its SHA-256, unless `record` lists it verified in its file's
    present state; a match is recorded there."""
    if record is not None and record.known(entry.name, before):
        return
    began = time.time_ns()
    if _sha256(buf) != entry.sha256:
        raise ModelFormatError(f"{folder}: shard {entry.name} does not match its SHA-256 in the manifest (damaged "
                               "or changed since it was converted)", hint=convert_again(folder, m.source, m.mmproj))
    if record is not None:
        record.hashed(entry.name, before, FileState.of(os.fstat(fd)), began)


MADV_POPULATE_READ = 22  # Linux 5.14+: fault the pages in for reading (the page cache's, no private copies)


def _mapped(fd: int) -> mmap.mmap:
    """The file mapped copy-on-write, its pages read in before this returns where the system can, else read ahead
    in the background. Not MAP_POPULATE: on a private writable mapping it write-faults every page, a private copy
    of the whole file that the page cache can neither share nor evict."""
    buf = mmap.mmap(fd, 0, access=mmap.ACCESS_COPY)
    if hasattr(buf, "madvise"):
        try:
            buf.madvise(MADV_POPULATE_READ)
        except OSError:  # an older kernel
            buf.madvise(mmap.MADV_WILLNEED)
    return buf


def _open_shard(folder: Path, m: Manifest, index: int, record: VerifiedShards | None) -> _Shard:
    """A shard mapped (copy-on-write: the tensors are writable views, the file is never written) with every page
    read in, by this worker (so the shards are read in parallel, not page by page as the one thread that copies
    the tensors out touches them), and checked."""
    entry = m.shards[index]
    try:
        with (folder / entry.name).open("rb") as f:
            before = FileState.of(os.fstat(f.fileno()))  # of the file mapped, not of a path replaced meanwhile
            buf = _mapped(f.fileno())
            _verify(folder, m, entry, buf, f.fileno(), record, before)
    except (OSError, ValueError) as exc:
        raise ModelFormatError(f"{folder}: shard {entry.name} cannot be read: {exc}") from None
    try:
        return _Shard(entry.name, _views(buf))
    except (ValueError, KeyError, TypeError, RuntimeError) as exc:
        raise ModelFormatError(f"{folder}: shard {entry.name} is not a readable safetensors file ({exc})",
                               hint=convert_again(folder, m.source, m.mmproj)) from None


def _views(buf: mmap.mmap) -> dict[str, torch.Tensor]:
    """The tensors of a safetensors file's bytes, as views (the 8-byte header length, the JSON header, the data;
    its writer aligns each tensor to its dtype)."""
    n = int.from_bytes(buf[:8], "little")
    header = json.loads(buf[8:8 + n])
    data = torch.frombuffer(buf, dtype=torch.uint8)
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        begin, end = info["data_offsets"]
        out[name] = data[8 + n + begin:8 + n + end].view(_DTYPES[info["dtype"]]).reshape(info["shape"])
    return out


def _shards(folder: Path, m: Manifest, record: VerifiedShards | None) -> Iterator[_Shard]:
    """The shards in order, each mapped and hashed by a worker a few shards ahead of the consumer."""
    workers = max(1, min(len(m.shards), os.cpu_count() or 1, _MAX_WORKERS))
    pool = ThreadPoolExecutor(workers)
    try:
        pending: deque = deque()
        for i in range(len(m.shards)):
            pending.append(pool.submit(_open_shard, folder, m, i, record))
            if len(pending) > workers:
                yield pending.popleft().result()
        while pending:
            yield pending.popleft().result()
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


def _bad(folder: Path, m: Manifest, name: str, why: str) -> ModelFormatError:
    return ModelFormatError(f"{folder}: tensor {name} {why}", hint=convert_again(folder, m.source, m.mmproj))


def _checked(folder: Path, m: Manifest, name: str, e: TensorEntry, shard: _Shard) -> list[torch.Tensor]:
    """The stored parts of a weight, checked against its manifest entry (a folder is never misread)."""
    missing = [p for p in e.parts(name) if p not in shard.tensors]
    if missing:
        raise _bad(folder, m, name, f"lacks {missing[0]} in shard {shard.name}")
    parts = [shard.tensors[p] for p in e.parts(name)]
    if e.format == "plain":
        ok = tuple(parts[0].shape) == e.shape
    elif e.format == "gguf":
        from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

        ok = len(e.shape) == 2 and sum(p.shape[0] for p in parts) == e.shape[0]
        for p, qtype in zip(parts, e.qtypes, strict=True):
            block, size = GGML_QUANT_SIZES[GGMLQuantizationType(qtype)]
            ok = ok and p.dtype == torch.uint8 and p.dim() == 2 and p.shape[1] == e.shape[1] // block * size
    else:
        n, k = e.shape
        want = [((n, k) if e.format == "q8" else (n, k // 2), torch.int8 if e.format == "q8" else torch.uint8),
                ((n, k // GROUP), parts[1].dtype), ((n, k // 8), torch.uint8)][:len(parts)]
        ok = parts[1].dtype in (torch.bfloat16, torch.float16) and \
            all(tuple(p.shape) == s and p.dtype == d for p, (s, d) in zip(parts, want, strict=True))
    if not ok:
        raise _bad(folder, m, name, f"does not have the shape or dtype its manifest entry says ({e.format} "
                   f"{list(e.shape)})")
    return parts


def _mover(device: torch.device, total: int) -> Callable[[torch.Tensor], torch.Tensor]:
    """How stored tensors reach the device: on CUDA through pinned staging buffers, `total` bytes at most; on the
    CPU they stay the mapped views."""
    if device.type == "cuda":
        return StagedCopies(device, total).to_device
    return lambda t: t.to(device)


def _weight(e: TensorEntry, parts: list[torch.Tensor], dtype: torch.dtype, move: Callable[[torch.Tensor],
            torch.Tensor], tiled: bool, kept: tuple[int, ...]):
    """A stored weight as the loaders give it: plain tensors and quantized codes moved to the device; GGUF blocks
    kept where the device's kernels read all of their types (`kept`), else dequantized."""
    if e.format == "plain":
        return move(parts[0])
    if e.format == "gguf":
        if all(q in kept for q in e.qtypes):
            return GGUFWeight(tuple(BlockRows(q, move(p)) for q, p in zip(e.qtypes, parts, strict=True)), e.shape[1],
                              dtype)
        from .gguf_dequant import dequantize

        rows = [dequantize(p.numpy().reshape(-1), q, (p.shape[0], e.shape[1])) for q, p in zip(e.qtypes, parts,
                                                                                              strict=True)]
        return move(torch.from_numpy(np.concatenate(rows)).to(dtype))
    on = [move(p) for p in parts]
    q = QuantizedWeight(e.format, on[0], on[1], on[2] if len(on) > 2 else None, e.shape[0], e.shape[1], dtype)
    return prefer_tiles(q) if tiled else q


def _tokenizer(folder: Path, m: Manifest, spec: ModelSpec):
    if m.source_kind == "gguf":
        from ..tokenizer.gguf_vocab import tokenizer_from_gguf

        meta = _gguf_metadata(folder)
        return tokenizer_from_gguf(meta), meta.get("tokenizer.chat_template")
    from ..tokenizer.hf_folder import tokenizer_from_folder

    return tokenizer_from_folder(folder, spec)


def load_converted(folder: Path, dtype: torch.dtype, device: torch.device, tiled: bool = False,
                   vision: bool = True, verified_shards: Path | None = None) -> LoadedModel:
    """A converted folder's model, in the compute dtype it was converted for. `tiled`: q4/q5 weights take the tiled
    layout where the CUDA kernels run (`prefer_tiles`); a vision tower is loaded only with `vision`. Each
    shard's SHA-256 is checked, but not that of a shard the record at `verified_shards` lists as verified in its
    file's present state; the shards it hashes are added there."""
    m = read_manifest(folder)
    asked = str(dtype).removeprefix("torch.")
    if m.dtype != asked:
        raise UserError(f"{folder} was converted for {m.dtype} compute, and this engine computes in {asked}",
                        hint=f"run it with --set dtype={m.dtype}, or convert it for {asked}: ninfer convert "
                        f"{m.source} {folder} --set dtype={asked} --force")
    _check_sizes(folder, m)
    spec = _spec(folder, m)
    vision_cfg = None
    if vision and spec.vision_params and m.source_kind == "folder":
        from .safetensors import folder_vision

        vision_cfg = folder_vision(folder, hf_config(folder))
    elif vision and spec.vision_params:
        vision_cfg = _projector(folder, m, spec)[0]
    tokenizer, template = _tokenizer(folder, m, spec)
    kept = kept_types(device) if any(e.format == "gguf" for e in m.tensors.values()) else ()
    by_shard: dict[str, list[str]] = {}
    for name, e in m.tensors.items():
        if vision_cfg is not None or not name.startswith(VISION_PREFIX):
            by_shard.setdefault(e.shard, []).append(name)
    record = VerifiedShards(verified_shards, folder, m) if verified_shards else None
    move = _mover(device, sum(s.bytes for s in m.shards))
    weights = {}
    try:
        for shard in _shards(folder, m, record):
            for name in by_shard.get(shard.name, ()):
                e = m.tensors[name]
                weights[name] = _weight(e, _checked(folder, m, name, e, shard), dtype, move, tiled, kept)
    finally:  # a shard verified stays verified, whatever stops the load after it
        if record is not None:
            record.save()
    return LoadedModel(spec, weights, tokenizer, template, str(folder), vision_cfg)
