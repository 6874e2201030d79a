"""The manifest of a converted model folder (`ninfer convert`, `engine/convert.py`; loaded by `converted.py`):
what the folder holds and what it was made from, read without torch (`ninfer show` reads it too).

`ninfer-model.json`:
- `format` ("ninfer-model") and `version`: a folder of another version is refused with the command that writes
  it again, never read by guesswork;
- `source`: the path it was converted from, its kind ("folder" or "gguf"), a GGUF model's vision projector file
  (`mmproj`, where one was converted with it) and the name, size and SHA-256 of each file the conversion read (the
  whole files: a header and a size are the same for every fine-tune of one shape);
- `dtype`: the compute dtype the weights were converted for (16-bit scales are bf16 for bf16, fp16 otherwise), and
  `weights`: the profile's format per class of tensor (`WeightFormats`);
- `tensors`: for each canonical weight name, its `format` ("plain"; "q8", "q5", "q4"; or "gguf", a GGUF file's own
  blocks with their `qtypes`), its `shape` and the `shard` that holds it;
- `shards`: the name, size and SHA-256 of each safetensors shard.
"""
from __future__ import annotations

import hashlib
import json
import shlex
from dataclasses import asdict, dataclass
from pathlib import Path

from ..config import WeightFormats
from ..errors import ModelFormatError, UserError

MANIFEST = "ninfer-model.json"
FORMAT = "ninfer-model"
VERSION = 1
GGUF_METADATA = "gguf-metadata.gguf"  # a GGUF source's metadata, as a GGUF file without tensors
MMPROJ_METADATA = "mmproj-metadata.gguf"  # its vision projector's, likewise (the tower is in the shards)
QUANT_PARTS = {"q8": ("codes", "scales"), "q5": ("codes", "scales", "high"), "q4": ("codes", "scales")}


@dataclass(frozen=True)
class FileEntry:
    name: str
    bytes: int
    sha256: str


@dataclass(frozen=True)
class TensorEntry:
    format: str  # "plain", a group-quantized format ("q8", "q5", "q4"), or "gguf" (a GGUF file's blocks)
    shape: tuple[int, ...]  # the weight's ([out, in] for packed ones)
    shard: str
    qtypes: tuple[int, ...] = ()  # "gguf": the GGMLQuantizationType of each run of rows

    def parts(self, name: str) -> list[str]:
        """The names of the safetensors tensors that hold this weight."""
        if self.format == "plain":
            return [name]
        if self.format == "gguf":
            return [f"{name}.blocks.{i}" for i in range(len(self.qtypes))]
        return [f"{name}.{part}" for part in QUANT_PARTS[self.format]]


@dataclass(frozen=True)
class Manifest:
    source: str  # the path the folder was converted from
    source_kind: str  # "folder" (HF safetensors) or "gguf"
    source_files: tuple[FileEntry, ...]
    dtype: str  # the compute dtype, as torch names it without "torch."
    weights: dict[str, str]  # WeightFormats.as_dict()
    tensors: dict[str, TensorEntry]
    shards: tuple[FileEntry, ...]
    written_by: str
    mmproj: str = ""  # a GGUF source's vision projector file, converted with it

    def to_json(self) -> dict:
        return {"format": FORMAT, "version": VERSION, "written_by": self.written_by,
                "source": {"path": self.source, "kind": self.source_kind,
                           **({"mmproj": self.mmproj} if self.mmproj else {}),
                           "files": [asdict(f) for f in self.source_files]},
                "dtype": self.dtype, "weights": self.weights,
                "tensors": {name: {k: v for k, v in asdict(t).items() if k != "qtypes" or t.qtypes}
                            for name, t in self.tensors.items()},
                "shards": [asdict(s) for s in self.shards]}

    @classmethod
    def from_json(cls, data: dict) -> Manifest:
        source = data["source"]
        weights = WeightFormats(**data["weights"]).as_dict()  # an unknown class or format fails here
        tensors = {name: TensorEntry(t["format"], tuple(t["shape"]), t["shard"], tuple(t.get("qtypes", ())))
                   for name, t in data["tensors"].items()}
        shards = tuple(FileEntry(**s) for s in data["shards"])
        names = {s.name for s in shards}
        for s in shards:
            if Path(s.name).name != s.name or not s.name.endswith(".safetensors"):
                raise ValueError(f"shard {s.name!r} is not a safetensors file of the folder")
        for name, t in tensors.items():
            if t.format not in ("plain", "gguf", *QUANT_PARTS):
                raise ValueError(f"tensor {name} has the unknown format {t.format!r}")
            if t.shard not in names:
                raise ValueError(f"tensor {name} is in {t.shard!r}, which is not among the shards")
        if source["kind"] not in ("folder", "gguf"):
            raise ValueError(f"unknown source kind {source['kind']!r}")
        return cls(str(source["path"]), source["kind"], tuple(FileEntry(**f) for f in source["files"]),
                   str(data["dtype"]), weights, tensors, shards, str(data.get("written_by", "")),
                   str(source.get("mmproj", "")))

    def formats_text(self) -> str:
        return ", ".join(f"{k} {v}" for k, v in self.weights.items()) + f" ({self.dtype})"


def convert_again(folder: Path, source: str = "SRC", mmproj: str = "") -> str:
    """The hint of every refusal: the command that writes the folder again (with the GGUF projector it was
    converted with)."""
    projector = f" --mmproj {shlex.quote(mmproj)}" if mmproj else ""
    return f"convert the model again with this ninfer: ninfer convert {shlex.quote(source)} " \
           f"{shlex.quote(str(folder))}{projector} --force"


def read_manifest(folder: Path) -> Manifest:
    """A converted folder's manifest, or a one-line refusal (another format version, or not a manifest at all)."""
    path = folder / MANIFEST
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ModelFormatError(f"{path} is not readable JSON: {exc}", hint=convert_again(folder)) from None
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise ModelFormatError(f"{path} is not a ninfer model manifest", hint=convert_again(folder))
    source = data.get("source")
    source = str(source.get("path")) if isinstance(source, dict) and source.get("path") else "SRC"
    version = data.get("version")
    if version != VERSION:
        newer = isinstance(version, int) and version > VERSION
        raise ModelFormatError(f"{folder} holds a converted model of format version {version}; this ninfer reads "
                               f"version {VERSION}",
                               hint=convert_again(folder, source) + (" (or update ninfer)" if newer else ""))
    try:
        return Manifest.from_json(data)
    except (KeyError, TypeError, ValueError, AttributeError, UserError) as exc:
        raise ModelFormatError(f"{path} is incomplete or damaged ({type(exc).__name__}: {exc})",
                               hint=convert_again(folder, source)) from None


def sha256_file(path: Path) -> str:
    """A file's SHA-256, read in 16 MiB blocks (the hub publishes each LFS file's; a manifest records each shard's)."""
    sha = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 24):
            sha.update(chunk)
    return sha.hexdigest()
