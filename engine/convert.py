"""`ninfer convert`: a HF folder or a GGUF file read once through its own loader with a profile's weight formats, on
the CPU (the row-major layout `quantize` returns, which every device loads; tiles are made at load where they run),
then written as a converted folder (`loaders/manifest.py`, `loaders/converted.py`) that loads without quantizing.
The vision tower goes with the model: a folder's own, or a GGUF model's projector file (`--mmproj`, or the one
beside it; its metadata kept as a GGUF file without tensors).

The folder is written beside OUT under a temporary name and renamed into place at the end: a failed or interrupted
conversion never leaves a folder that looks complete. The source's files are hashed while its loader reads them
(the second read comes from the page cache)."""
from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path

import psutil
import torch
from safetensors.torch import save_file

from . import __version__
from .config import WeightFormats
from .errors import UserError
from .loaders import LoadedModel, check_mmproj, model_kind
from .loaders.manifest import GGUF_METADATA, MANIFEST, MMPROJ_METADATA, FileEntry, Manifest, TensorEntry, sha256_file
from .quant.gguf_blocks import GGUFWeight
from .quant.qweight import QuantizedWeight, load_transform, untile

SHARD_BYTES = 1 << 30  # whole weights per shard up to this: a load hashes several shards at once, one per core
# A HF folder's files that are weights (read through the loader, not copied); everything else at its top level
# (config, tokenizer, template, processor configs, license) is copied as it is.
_WEIGHT_FILES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".h5", ".msgpack", ".ckpt", ".onnx")
_INDEX = "model.safetensors.index.json"


@dataclass(frozen=True)
class Conversion:
    folder: Path
    manifest: Manifest

    @property
    def bytes(self) -> int:
        return sum(s.bytes for s in self.manifest.shards)


def _entry(path: Path) -> FileEntry:
    return FileEntry(path.name, path.stat().st_size, sha256_file(path))


def _check_out(sources: list[Path], out: Path, force: bool) -> None:
    """OUT may be new or an empty folder; with `force`, a converted folder (never any other folder, nor one a
    source lies in)."""
    for src in sources:
        if src.resolve().is_relative_to(out.resolve()):
            raise UserError(f"{out} holds the source {src}, so it cannot be written",
                            hint="pick another output folder")
    if not out.exists() or (out.is_dir() and not any(out.iterdir())):
        return
    if not (out.is_dir() and (out / MANIFEST).is_file()):
        raise UserError(f"{out} exists and is not a converted model folder", hint="pick another output folder")
    if not force:
        raise UserError(f"{out} is a converted model folder already", hint="pass --force to replace it")


def _side_files(src: Path) -> list[Path]:
    """The HF folder's files that are not weights (hidden ones aside)."""
    return [p for p in sorted(src.iterdir()) if p.is_file() and not p.name.startswith(".")
            and not p.name.endswith(_WEIGHT_FILES) and p.name not in (_INDEX, MANIFEST)]


def _stored(name: str, w) -> tuple[TensorEntry, dict[str, torch.Tensor]]:
    """A loaded weight's manifest entry (its shard not yet given) and the tensors that store it."""
    if isinstance(w, QuantizedWeight):
        w = untile(w)
        entry = TensorEntry(w.fmt, (w.out_features, w.in_features), "")
        parts = [w.codes, w.scales] + ([] if w.high is None else [w.high])
    elif isinstance(w, GGUFWeight):
        entry = TensorEntry("gguf", (w.out_features, w.in_features), "", tuple(p.qtype for p in w.parts))
        parts = [p.data for p in w.parts]
    else:
        entry, parts = TensorEntry("plain", tuple(w.shape), ""), [w]
    return entry, {k: t.contiguous() for k, t in zip(entry.parts(name), parts, strict=True)}


def _load(src: Path, kind: str, formats: WeightFormats, dtype: torch.dtype, projector: Path | None) -> LoadedModel:
    """The source as the engine loads it on the CPU with these formats, the vision tower included (a GGUF
    model's from its `projector` file); a GGUF file's quantized tensors stay in its blocks where no format asks
    for another (a load keeps those its device's kernels read and dequantizes the rest, as it does the file's)."""
    cpu = torch.device("cpu")
    transform = load_transform(formats)
    if kind == "gguf":
        from .loaders.gguf import load_gguf

        return load_gguf(src, dtype, cpu, transform, blocks=transform is None, vision=projector is not None,
                         mmproj=str(projector or ""))
    from .loaders.safetensors import load_hf_folder

    return load_hf_folder(src, dtype, cpu, transform, vision=True)


def _write_shards(weights: dict, folder: Path, pool: ThreadPoolExecutor) -> tuple[dict, tuple[FileEntry, ...]]:
    """The weights in shards of whole weights, in their loaded order; each shard hashed as the next is written."""
    groups: list[list[tuple[str, TensorEntry, dict]]] = [[]]
    size = 0
    for name, w in weights.items():
        entry, parts = _stored(name, w)
        nbytes = sum(t.nbytes for t in parts.values())
        if groups[-1] and size + nbytes > SHARD_BYTES:
            groups.append([])
            size = 0
        groups[-1].append((name, entry, parts))
        size += nbytes
    tensors, hashed = {}, []
    for i, group in enumerate(groups):
        shard = folder / f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors"
        save_file({k: t for _, _, parts in group for k, t in parts.items()}, str(shard), metadata={"format": "pt"})
        hashed.append(pool.submit(_entry, shard))
        tensors.update({name: replace(entry, shard=shard.name) for name, entry, _ in group})
    return tensors, tuple(f.result() for f in hashed)


def convert(src: str, out: Path, formats: WeightFormats, dtype: torch.dtype, force: bool = False,
            log: Callable[[str], None] | None = None, mmproj: str = "") -> Conversion:
    """Write the model `src` (a HF folder or a .gguf file) as a converted folder `out`, its projections in
    `formats` for `dtype` compute, with its vision tower (a GGUF model's from the projector file `mmproj`, empty =
    the one beside it, if any). `force` replaces a converted folder at `out`."""
    kind = model_kind(src)
    if kind not in ("folder", "gguf"):
        what = "a synthetic model has no files" if kind == "synthetic" else f"{src} is a converted folder already"
        raise UserError(f"nothing to convert: {what}", hint="give a HF model folder or a .gguf file")
    check_mmproj(src, kind, mmproj)
    path = Path(src).expanduser()
    out = out.expanduser()
    projector = None
    if kind == "gguf":  # found and checked against the model before anything is written
        from .loaders.gguf import projector_file

        projector = projector_file(path, mmproj)
    _check_out([path] if projector is None else [path, projector], out, force)
    say = log or (lambda _: None)
    side = _side_files(path) if kind == "folder" else []
    if kind == "folder":
        from .loaders.safetensors import shard_files

        sources = [*shard_files(path), *side]
    else:
        sources = [path] if projector is None else [path, projector]
    try:
        return _convert(path, kind, out, formats, dtype, say, side, sources, projector)
    except OSError as exc:  # disk full, no permission: the cause and the file
        where = f" ({exc.filename})" if exc.filename else ""
        raise UserError(f"converting {path} to {out} failed: {exc.strerror or exc}{where}",
                        hint="free disk space or check permissions there, or give another OUT folder") from None


def _convert(path: Path, kind: str, out: Path, formats: WeightFormats, dtype: torch.dtype,
             say: Callable[[str], None], side: list[Path], sources: list[Path], projector: Path | None) -> Conversion:
    out.parent.mkdir(parents=True, exist_ok=True)
    _remove_abandoned(out)
    tmp = out.parent / f".{out.name}.converting-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        with ThreadPoolExecutor(2) as pool:
            source_hashes = [pool.submit(_entry, p) for p in sources]  # beside the load
            say(f"reading {path}" + ("" if projector is None else f" and its vision projector {projector.name}")
                + " on the CPU" + (" and quantizing it" if formats.quantized() else ""))
            loaded = _load(path, kind, formats, dtype, projector)
            say(f"writing {len(loaded.weights)} weights to {out}")
            tensors, shards = _write_shards(loaded.weights, tmp, pool)
            source_files = tuple(f.result() for f in source_hashes)
        if kind == "gguf":
            from .loaders.gguf_file import metadata_only

            (tmp / GGUF_METADATA).write_bytes(metadata_only(path))
            if projector is not None:
                (tmp / MMPROJ_METADATA).write_bytes(metadata_only(projector))
        for p in side:
            shutil.copy2(p, tmp / p.name)
        manifest = Manifest(str(path.resolve()), kind, source_files, str(dtype).removeprefix("torch."),
                            formats.as_dict(), tensors, shards, f"ninfer {__version__}",
                            "" if projector is None else str(projector.resolve()))
        (tmp / MANIFEST).write_text(json.dumps(manifest.to_json(), indent=1) + "\n", encoding="utf-8")
        replaced = out.parent / f".{out.name}.replaced-{os.getpid()}" if out.exists() else None
        if replaced is not None:
            out.rename(replaced)
        try:
            tmp.rename(out)
        except OSError:
            if replaced is not None:
                replaced.rename(out)
            raise
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if replaced is not None:
        shutil.rmtree(replaced, ignore_errors=True)
    return Conversion(out, manifest)


def _remove_abandoned(out: Path) -> None:
    """Folders an earlier conversion to `out` left when it was killed (its process is gone): tens of GB each."""
    for left in out.parent.glob(f".{out.name}.converting-*"):
        pid = left.name.rsplit("-", 1)[1]
        if pid.isdigit() and not psutil.pid_exists(int(pid)):
            shutil.rmtree(left, ignore_errors=True)
