"""Launches of the engine's NVRTC-compiled kernels through the driver's `cuLaunchKernelEx`, called through ctypes:
unlike torch's loader (`cuLaunchKernel`), it takes launch attributes, and programmatic dependent launch
(`kernels/pdl.py`) is one. The kernel comes from torch's module loader; only the launch is ours."""
from __future__ import annotations

import ctypes
import functools

import torch

PROGRAMMATIC_STREAM_SERIALIZATION = 6  # CUlaunchAttributeID


class _Attribute(ctypes.Structure):
    # CUlaunchAttribute: the id, padding to 8 bytes, then a 64-byte union whose first int is this attribute's flag
    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4), ("value", ctypes.c_int),
                ("rest", ctypes.c_char * 60)]


class _Config(ctypes.Structure):
    # CUlaunchConfig
    _fields_ = [("grid", ctypes.c_uint * 3), ("block", ctypes.c_uint * 3), ("shared", ctypes.c_uint),
                ("stream", ctypes.c_void_p), ("attrs", ctypes.POINTER(_Attribute)), ("count", ctypes.c_uint)]


@functools.cache
def _driver() -> ctypes.CDLL:
    lib = ctypes.CDLL("libcuda.so.1")
    lib.cuLaunchKernelEx.argtypes = [ctypes.POINTER(_Config), ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
    return lib


def launch(kernel, grid: tuple[int, int, int], block: tuple[int, int, int], shared: int, args: list,
           pdl: bool) -> None:
    """`kernel` (torch's `_cuda_load_module` entry) on the current stream; args are tensors (their data
    pointers) and ints (C ints). With `pdl` the launch may overlap the kernel before it, so the kernel must
    wait on the grid dependency (`griddepcontrol.wait`) before it reads that kernel's output or stores."""
    values = [ctypes.c_void_p(a.data_ptr()) if isinstance(a, torch.Tensor) else ctypes.c_int(a) for a in args]
    pointers = (ctypes.c_void_p * len(values))(*[ctypes.addressof(v) for v in values])
    attribute = _Attribute(id=PROGRAMMATIC_STREAM_SERIALIZATION, value=1)
    config = _Config(grid=(ctypes.c_uint * 3)(*grid), block=(ctypes.c_uint * 3)(*block), shared=shared,
                     stream=torch.cuda.current_stream().cuda_stream,
                     attrs=ctypes.pointer(attribute) if pdl else None, count=int(pdl))
    lib = _driver()
    result = lib.cuLaunchKernelEx(ctypes.byref(config), kernel.func, pointers, None)
    if result != 0:
        message = ctypes.c_char_p()
        lib.cuGetErrorString(result, ctypes.byref(message))
        raise RuntimeError(f"CUDA launch failed: {(message.value or b'unknown error').decode()}")
