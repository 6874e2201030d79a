"""The engine's C kernels for the CPU (`cpu_kernels.c` and the files it includes, beside this one), compiled at first
use with the machine's C compiler for its own vector units (-march=native) and loaded through ctypes.

A built library is kept in the folder the engine is given (`use_dir`: the front end gives its cache dir's) under two
keys: the machine's (the compiler and the CPU) and the build's (the sources and the flags), so a changed one compiles
again and machines sharing a home directory never load each other's (nor remove them: a build removes only its
machine's stale ones); without a folder it is built in a temporary one for the process. ctypes releases the GIL
during a call. A machine without a compiler gets an OSError that says so; callers then keep their torch paths."""
from __future__ import annotations

import atexit
import ctypes
import hashlib
import logging
import os
import platform
import shlex
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

SOURCE = Path(__file__).with_name("cpu_kernels.c")
# -ffp-contract=off: a product and a sum round separately, as torch's CPU ops and numpy round them
FLAGS = ("-O3", "-ffp-contract=off", "-fno-math-errno", "-fPIC", "-shared")
# Tried in order: this CPU's vector units; a compiler without -march=native.
VARIANTS = (("-march=native",), ())
_lock = threading.Lock()
_state: dict[str, ctypes.CDLL | str | Path] = {}
_signed: set[int] = set()  # the signature tables (module constants) already applied
log = logging.getLogger(__name__)


class CompileError(OSError):
    """The compiler refused the sources (with every variant): building again elsewhere would not help."""


def use_dir(folder: str) -> None:
    """Keep built libraries in `folder` (empty: a temporary folder for this process)."""
    with _lock:
        if folder:
            _state["dir"] = Path(folder)
        else:
            _state.pop("dir", None)


def _cache_dir() -> Path:
    if "dir" not in _state:
        _state["dir"] = _temporary_dir()
    return _state["dir"]


def _temporary_dir() -> Path:
    """A folder for this process's build, removed at exit."""
    tmp = tempfile.TemporaryDirectory(prefix="ninfer-cpu-kernels-")
    atexit.register(tmp.cleanup)
    return Path(tmp.name)


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.processor()


def _compile(compiler: list[str], source: Path, out: Path) -> None:
    for variant in VARIANTS:
        r = subprocess.run([*compiler, *FLAGS, *variant, str(source), "-o", str(out), "-lm", "-lpthread"],
                           capture_output=True, text=True)
        if r.returncode == 0:
            return
    raise CompileError(r.stderr.strip().splitlines()[-1] if r.stderr.strip() else f"{compiler[0]} failed")


def _texts(source: Path) -> list[str]:
    """The source's text and that of the files of this folder it includes (`#include "x.c"`), recursively: a
    change to any of them is a change to the library."""
    text = source.read_text()
    found = [text]
    for line in text.splitlines():
        if line.startswith('#include "'):
            found.extend(_texts(source.with_name(line.split('"')[1])))
    return found


def _build(source: Path) -> ctypes.CDLL:
    found = shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    compiler = shlex.split(os.environ.get("CC", "")) or ([found] if found else [])  # CC may be "ccache gcc"
    if not compiler:
        raise OSError("no C compiler (cc, gcc or clang) on PATH")
    machine = _machine_key(compiler)
    path = _cache_dir() / f"{source.stem}-{machine}-{_key(*_texts(source), ' '.join(FLAGS), repr(VARIANTS))}.so"
    try:
        return _load(compiler, source, path, machine)
    except CompileError:
        raise
    except OSError as exc:  # a folder that cannot be written, a kept file that does not load twice
        log.warning("the CPU kernels' folder %s failed (%s): building them in a temporary folder", path.parent, exc)
        return _load(compiler, source, _temporary_dir() / path.name, machine)


def _machine_key(compiler: list[str]) -> str:
    """What a build depends on besides the sources: the compiler (its version, and its own path too: two wrappers of
    one compiler print the same version) and the CPU it builds for."""
    version = subprocess.run([*compiler, "--version"], capture_output=True, text=True).stdout
    return _key(version, *compiler, str(shutil.which(compiler[0])), platform.machine(), _cpu_flags())


def _key(*parts: str) -> str:
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:16]


def _load(compiler: list[str], source: Path, path: Path, machine: str) -> ctypes.CDLL:
    """The library at `path`, built there first where it is missing, or where the file kept there does not load
    (truncated by a full disk, say). A build removes the folder's other builds under the same `machine` key (older
    sources or flags): a process that still has one loaded keeps it, one that needs it builds it again. Other
    machines' builds stay: they share the folder through a home directory and are not stale for them."""
    if path.is_file():
        try:
            return ctypes.CDLL(str(path))
        except OSError:
            path.unlink(missing_ok=True)
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=path.parent) as tmp:  # another process may build it meanwhile
        built = Path(tmp) / path.name
        _compile(compiler, source, built)
        os.replace(built, path)
    for old in path.parent.glob(f"cpu_*-{machine}-*.so"):
        if old != path:
            old.unlink(missing_ok=True)
    return ctypes.CDLL(str(path))


def library(signatures: dict[str, tuple[list, object]]) -> ctypes.CDLL:
    """The compiled kernels with these functions' (argtypes, restype) set; built once per process (or read from the
    folder). OSError says why there is none (and is raised again on every later call)."""
    with _lock:
        if "lib" not in _state:
            try:
                _state["lib"] = _build(SOURCE)
            except (OSError, subprocess.SubprocessError) as exc:
                _state["lib"] = f"the CPU kernels (cpu_kernels.c) could not be built: {exc}"
                log.warning("%s; the CPU paths run in torch (GGUF weights dequantized)", _state["lib"])
        lib = _state["lib"]
        if isinstance(lib, str):
            raise OSError(lib)
        if id(signatures) not in _signed:
            for fn, (args, res) in signatures.items():
                getattr(lib, fn).argtypes, getattr(lib, fn).restype = args, res
            _signed.add(id(signatures))
        return lib
