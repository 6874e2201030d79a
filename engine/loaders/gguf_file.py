"""A GGUF file's header (metadata and tensor table) read in one pass, and its tensors as views of the mapped file.

The `gguf` package's GGUFReader makes a numpy view per value: a 49K-token vocabulary and its merges are ~500K
views, seconds of start-up on a small CPU. Here each string is one slice of the mapped bytes and each numeric
array one `frombuffer`. The package still names the types and block sizes (`gguf.constants`) and decodes the
block formats `gguf_dequant` does not.
"""
from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import numpy as np
from gguf.constants import GGML_QUANT_SIZES, GGUF_DEFAULT_ALIGNMENT, GGUF_MAGIC, GGMLQuantizationType, GGUFValueType

from ..errors import ModelFormatError

VERSIONS = (2, 3)
_SCALARS: dict[int, str] = {
    GGUFValueType.UINT8: "B", GGUFValueType.INT8: "b", GGUFValueType.UINT16: "H", GGUFValueType.INT16: "h",
    GGUFValueType.UINT32: "I", GGUFValueType.INT32: "i", GGUFValueType.FLOAT32: "f", GGUFValueType.BOOL: "?",
    GGUFValueType.UINT64: "Q", GGUFValueType.INT64: "q", GGUFValueType.FLOAT64: "d",
}
_U32, _U64 = struct.Struct("<I"), struct.Struct("<Q")


@dataclass(frozen=True)
class TensorInfo:
    name: str
    qtype: int  # a GGMLQuantizationType value (unknown ones are kept, for the loader's error)
    shape: tuple[int, ...]  # torch order: the slowest dimension first
    offset: int  # from the start of the file
    nbytes: int


@dataclass(frozen=True)
class GGUFHeader:
    metadata: dict
    tensors: tuple[TensorInfo, ...]


class _Cursor:
    def __init__(self, buf: mmap.mmap) -> None:
        self.buf, self.pos = buf, 0

    def u32(self) -> int:
        (v,) = _U32.unpack_from(self.buf, self.pos)
        self.pos += 4
        return v

    def u64(self) -> int:
        (v,) = _U64.unpack_from(self.buf, self.pos)
        self.pos += 8
        return v

    def string(self) -> str:
        n = self.u64()
        end = self.pos + n
        if end > len(self.buf):
            raise ValueError("a string runs past the end of the file")
        s = self.buf[self.pos:end].decode("utf-8")
        self.pos = end
        return s

    def strings(self, count: int) -> list[str]:
        """`count` strings in a row (a vocabulary: the loop the load spends its header time in)."""
        buf, pos, unpack, out = self.buf, self.pos, _U64.unpack_from, []
        append = out.append
        for _ in range(count):
            (n,) = unpack(buf, pos)
            pos += 8
            append(buf[pos:pos + n].decode("utf-8"))
            pos += n
        if pos > len(buf):
            raise ValueError("a string runs past the end of the file")
        self.pos = pos
        return out

    def value(self, vtype: int):
        if vtype == GGUFValueType.STRING:
            return self.string()
        if vtype == GGUFValueType.ARRAY:
            itype, count = self.u32(), self.u64()
            if itype in _SCALARS:
                dtype = np.dtype("<" + _SCALARS[itype])
                arr = np.frombuffer(self.buf, dtype=dtype, count=count, offset=self.pos)
                self.pos += arr.nbytes
                return arr.tolist()
            if itype == GGUFValueType.STRING:
                return self.strings(count)
            return [self.value(itype) for _ in range(count)]
        fmt = _SCALARS.get(vtype)
        if fmt is None:
            raise ValueError(f"unknown metadata value type {vtype}")
        (v,) = struct.unpack_from("<" + fmt, self.buf, self.pos)
        self.pos += struct.calcsize(fmt)
        return v


def qtype_name(qtype: int) -> str:
    """A tensor type's name, or its number for one this gguf package does not know."""
    return GGMLQuantizationType(qtype).name if qtype in GGMLQuantizationType._value2member_map_ else f"#{qtype}"


def _nbytes(name: str, qtype: int, shape: tuple[int, ...]) -> int:
    """Stored bytes of a tensor (0 for a type this gguf package does not know: the loader refuses it by name)."""
    try:
        block, size = GGML_QUANT_SIZES[GGMLQuantizationType(qtype)]
    except (ValueError, KeyError):
        return 0
    if shape and shape[-1] % block:  # blocks run along a row: a row that does not end on one is a damaged table
        raise ValueError(f"tensor {name!r} has rows of {shape[-1]} values, not a multiple of the "
                         f"{qtype_name(qtype)} block ({block})")
    return int(np.prod(shape, dtype=np.int64)) // block * size


def _parse(buf: mmap.mmap) -> GGUFHeader:
    cur = _Cursor(buf)
    if cur.u32() != GGUF_MAGIC:
        raise ValueError("no GGUF magic")
    version = cur.u32()
    if version not in VERSIONS:
        order = "big-endian" if version & 0xFFFF == 0 else f"version {version}"
        raise ValueError(f"GGUF {order} files are not supported (little-endian versions {VERSIONS} are)")
    n_tensors, n_kv = cur.u64(), cur.u64()
    metadata = {}
    for _ in range(n_kv):
        key = cur.string()
        metadata[key] = cur.value(cur.u32())
    infos = []
    for _ in range(n_tensors):
        name = cur.string()
        dims = [cur.u64() for _ in range(cur.u32())]
        qtype, offset = cur.u32(), cur.u64()
        shape = tuple(reversed(dims))  # ggml lists the fastest dimension first
        infos.append((name, qtype, shape, offset))
    align = int(metadata.get("general.alignment", GGUF_DEFAULT_ALIGNMENT))
    if align <= 0 or align & (align - 1):
        raise ValueError(f"general.alignment {align} is not a power of two")
    start = -(-cur.pos // align) * align
    tensors = tuple(TensorInfo(name, qtype, shape, start + off, _nbytes(name, qtype, shape))
                    for name, qtype, shape, off in infos)
    for t in tensors:
        if t.offset + t.nbytes > len(buf):
            raise ValueError(f"tensor {t.name!r} runs past the end of the file (truncated download?)")
    return GGUFHeader(metadata, tensors)


def _map(path: Path) -> mmap.mmap:
    with path.open("rb") as f:
        return mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)


@lru_cache(maxsize=4)
def _header(path: Path, size: int, mtime_ns: int) -> GGUFHeader:
    try:
        buf = _map(path)
    except (OSError, ValueError) as exc:
        raise ModelFormatError(f"{str(path)!r} cannot be read: {exc}") from None
    try:
        return _parse(buf)
    except (ValueError, struct.error, UnicodeDecodeError, OverflowError) as exc:
        raise ModelFormatError(f"{str(path)!r} is not a readable GGUF file: {exc}") from None
    finally:
        buf.close()


def read_header(path: Path) -> GGUFHeader:
    """The metadata and tensor table of a GGUF file, parsed once per file version (the memory plan and the
    load both ask for it)."""
    st = path.stat()
    return _header(path.resolve(), st.st_size, st.st_mtime_ns)


def metadata_only(path: Path) -> bytes:
    """A GGUF file's metadata as a GGUF file without tensors, its key-value bytes as they were (a converted folder
    keeps a GGUF source's vocabulary, template and geometry in it, read back by `read_header`)."""
    buf = _map(path)
    try:
        cur = _Cursor(buf)
        cur.pos = 8  # magic and version
        cur.u64()  # the tensor count, written as 0
        n_kv = cur.u64()
        for _ in range(n_kv):
            cur.string()
            cur.value(cur.u32())
        return buf[:8] + struct.pack("<QQ", 0, n_kv) + buf[24:cur.pos]
    finally:
        buf.close()


def tensor_bytes(path: Path, header: GGUFHeader) -> dict[str, np.ndarray]:
    """Each tensor's stored bytes as a uint8 view of the mapped file (pages are read as they are touched)."""
    buf = _map(path)
    whole = np.frombuffer(buf, dtype=np.uint8)
    return {t.name: whole[t.offset:t.offset + t.nbytes] for t in header.tensors}
