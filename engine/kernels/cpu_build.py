"""The engine's C kernels for the CPU (`cpu_*.c` beside this file), compiled at first use with the machine's C
compiler for its own vector units (-march=native) and loaded through ctypes.

A built library is kept in the cache dir under a key of its source, the compiler, the flags and the CPU, so a
changed one compiles again and machines sharing a home directory never load each other's. ctypes releases the GIL
during a call. OpenMP loops run on torch's own libgomp (the same soname, already loaded), so these kernels and
torch's ops share one thread pool. A machine without a compiler gets an OSError that says so; callers then keep
their torch paths."""
from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

# -ffp-contract=off: a product and a sum round separately, as torch's CPU ops and numpy round them
FLAGS = ("-O3", "-ffp-contract=off", "-fno-math-errno", "-fPIC", "-shared")
# Tried in order: this CPU's vector units and OpenMP; a compiler without -march=native; one without OpenMP (the
# loops then run on the calling thread).
VARIANTS = (("-march=native", "-fopenmp"), ("-fopenmp",), ())
_lock = threading.Lock()
_built: dict[str, ctypes.CDLL | str] = {}


def _cache_dir() -> Path:
    # the front end's cache dir (its NINFER_CACHE_DIR, else the platform's user cache dir for "ninfer")
    import platformdirs

    return Path(os.environ.get("NINFER_CACHE_DIR") or platformdirs.user_cache_dir("ninfer")) / "cpu-kernels"


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.processor()


def _compile(compiler: str, source: Path, out: Path) -> None:
    for variant in VARIANTS:
        r = subprocess.run([compiler, *FLAGS, *variant, str(source), "-o", str(out), "-lm"], capture_output=True,
                           text=True)
        if r.returncode == 0:
            return
    raise OSError(r.stderr.strip().splitlines()[-1] if r.stderr.strip() else f"{compiler} failed")


def _build(source: Path) -> ctypes.CDLL:
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    if compiler is None:
        raise OSError("no C compiler (cc, gcc or clang) on PATH")
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True).stdout
    key = hashlib.sha256("\n".join([source.read_text(), version, " ".join(FLAGS), repr(VARIANTS), platform.machine(),
                                    _cpu_flags()]).encode()).hexdigest()[:16]
    path = _cache_dir() / f"{source.stem}-{key}.so"
    if not path.is_file():
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=path.parent) as tmp:  # another process may build it meanwhile
            built = Path(tmp) / path.name
            _compile(compiler, source, built)
            os.replace(built, path)
    return ctypes.CDLL(str(path))


def library(name: str, signatures: dict[str, tuple[list, object]]) -> ctypes.CDLL:
    """The compiled `name`.c of this folder with its functions' (argtypes, restype) set; built once per process
    (or read from the cache). OSError says why there is none (and is raised again on every later call)."""
    with _lock:
        if name not in _built:
            try:
                lib = _build(Path(__file__).with_name(f"{name}.c"))
                for fn, (args, res) in signatures.items():
                    getattr(lib, fn).argtypes, getattr(lib, fn).restype = args, res
                _built[name] = lib
            except (OSError, subprocess.SubprocessError) as exc:
                _built[name] = f"the CPU kernels ({name}.c) could not be built: {exc}"
        got = _built[name]
        if isinstance(got, str):
            raise OSError(got)
        return got
