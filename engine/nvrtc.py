"""NVRTC, the CUDA runtime compiler, called through ctypes: the library torch's CUDA wheels bring, so the engine's
CUDA kernels compile on machines without a CUDA toolkit (torch's own `compile_kernel` adds the toolkit's include
folder and fails where there is none). `version()` tells a diagnosis whether it is there without touching a GPU."""
from __future__ import annotations

import ctypes

import torch


def library() -> ctypes.CDLL:
    """The NVRTC library of torch's CUDA version (OSError when absent, e.g. under a CPU build of torch)."""
    major = (torch.version.cuda or "13").split(".")[0]
    for name in (f"libnvrtc.so.{major}", "libnvrtc.so"):
        try:
            return ctypes.CDLL(name)
        except OSError:
            continue
    raise OSError("NVRTC (libnvrtc) not found: install torch's CUDA build, which brings it")


def version() -> str | None:
    """"major.minor" of the NVRTC the engine would use, None when there is none."""
    try:
        lib = library()
    except OSError:
        return None
    major, minor = ctypes.c_int(), ctypes.c_int()
    if lib.nvrtcVersion(ctypes.byref(major), ctypes.byref(minor)) != 0:
        return None
    return f"{major.value}.{minor.value}"


def compile_ptx(source: str, name: str, arch: str, options: list[str]) -> bytes:
    """PTX of `source` for sm_`arch` (e.g. "89"), with -D `options`; RuntimeError with NVRTC's log on failure."""
    lib = library()
    program = ctypes.c_void_p()
    _check(lib, lib.nvrtcCreateProgram(ctypes.byref(program), source.encode(), name.encode(), 0, None, None))
    flags = [f"--gpu-architecture=compute_{arch}", *options]
    array = (ctypes.c_char_p * len(flags))(*[o.encode() for o in flags])
    try:
        if lib.nvrtcCompileProgram(program, len(flags), array) != 0:
            size = ctypes.c_size_t()
            lib.nvrtcGetProgramLogSize(program, ctypes.byref(size))
            log = ctypes.create_string_buffer(size.value)
            lib.nvrtcGetProgramLog(program, log)
            raise RuntimeError(f"NVRTC could not compile {name}: {log.value.decode(errors='replace')}")
        size = ctypes.c_size_t()
        _check(lib, lib.nvrtcGetPTXSize(program, ctypes.byref(size)))
        out = ctypes.create_string_buffer(size.value)
        _check(lib, lib.nvrtcGetPTX(program, out))
        return out.raw
    finally:
        lib.nvrtcDestroyProgram(ctypes.byref(program))


def _check(lib: ctypes.CDLL, result: int) -> None:
    if result != 0:
        lib.nvrtcGetErrorString.restype = ctypes.c_char_p
        raise RuntimeError(f"NVRTC: {lib.nvrtcGetErrorString(result).decode()}")
