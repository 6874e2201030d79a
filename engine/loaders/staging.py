"""Weights copied from host memory (a shard's mapping) to a GPU through a few reused pinned staging buffers.

`tensor.to("cuda")` from pageable memory goes through the driver's own small pinned buffer and returns only when
the copy is done, so the host's reading of the next tensor and the link's transfer of this one take turns. Here the
host copies the bytes into a page-locked buffer and queues the transfer from it without waiting, then fills the next
buffer while that transfer runs; it waits for a buffer's transfers only before it writes that buffer again. The
staging memory is bounded: a tensor larger than a buffer goes in pieces, small ones share a buffer.

The transfers are queued on the device's current stream, where the work that reads the weights next (the tiling of
q4/q5 weights) is queued too, and where the caching allocator handed out their memory: no other stream needs to
wait for them. `engine/transfer.py`'s `to_device` pins a fresh copy of each tensor, which costs what it saves here.
The buffers come from torch's pinned-memory cache and go back to it (later pinned copies, such as the host KV
tier's, reuse them)."""
from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Protocol

import torch

STAGING_BYTES = 64 << 20  # per buffer: a transfer of this size runs for milliseconds, long beside its launch
BUFFERS = 2
_ALIGN = 512  # where pieces start in a buffer


@dataclass(frozen=True)
class Piece:
    """Bytes [begin, begin + length) of a tensor, staged at offset `at` of buffer `buffer`. `first`: the first
    piece of this turn of the buffer, written after the transfers of its last turn have run."""

    buffer: int
    at: int
    begin: int
    length: int
    first: bool


class Layout:
    """Where the bytes of a sequence of tensors are staged: each buffer in turn, filled from its start, then the
    next one."""

    def __init__(self, size: int, buffers: int) -> None:
        self.size = size
        self.buffers = buffers
        self._buffer = 0
        self._used = 0

    def pieces(self, nbytes: int) -> Iterator[Piece]:
        begin = 0
        while begin < nbytes:
            if self._used == self.size:
                self._buffer = (self._buffer + 1) % self.buffers
                self._used = 0
            length = min(nbytes - begin, self.size - self._used)
            yield Piece(self._buffer, self._used, begin, length, self._used == 0)
            self._used = min(self.size, -(-(self._used + length) // _ALIGN) * _ALIGN)
            begin += length


class Done(Protocol):
    def synchronize(self) -> None: ...


class Transfers(Protocol):
    """Where the staged bytes go: `copy` queues the copy of `src` (a staging buffer's bytes) into `dst` and returns
    what tells when it has run."""

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> Done: ...


class CudaTransfers:
    """Transfers queued on the device's current stream, each followed by an event."""

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> torch.cuda.Event:
        dst.copy_(src, non_blocking=True)
        done = torch.cuda.Event()
        done.record(torch.cuda.current_stream(dst.device))
        return done


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8)


class StagedCopies:
    """Host tensors copied to `device` through `buffers` staging buffers of at most `size` bytes (no larger than
    the `total` bytes to copy), pinned on CUDA. `to_device` returns the device tensor at once, its bytes queued."""

    def __init__(self, device: torch.device, total: int, transfers: Transfers | None = None,
                 size: int = STAGING_BYTES, buffers: int = BUFFERS) -> None:
        self.device = device
        self._transfers = transfers or CudaTransfers()
        self._layout = Layout(max(_ALIGN, min(size, total)), buffers)
        self._pinned = device.type == "cuda"
        self._staging: list[torch.Tensor | None] = [None] * buffers  # allocated at first use
        self._done: list[Done | None] = [None] * buffers  # the last transfer from each buffer

    def _buffer(self, i: int) -> torch.Tensor:
        if self._staging[i] is None:
            self._staging[i] = torch.empty(self._layout.size, dtype=torch.uint8, pin_memory=self._pinned)
        return self._staging[i]

    def to_device(self, t: torch.Tensor) -> torch.Tensor:
        out = torch.empty(t.shape, dtype=t.dtype, device=self.device)
        src, dst = _bytes(t.contiguous()), _bytes(out)
        for p in self._layout.pieces(src.numel()):
            if p.first and self._done[p.buffer] is not None:
                self._done[p.buffer].synchronize()
            staged = self._buffer(p.buffer)[p.at:p.at + p.length]
            staged.copy_(src[p.begin:p.begin + p.length])
            self._done[p.buffer] = self._transfers.copy(dst[p.begin:p.begin + p.length], staged)
        return out
