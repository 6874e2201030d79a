"""Lanes: the working caches that CUDA graphs are captured against, one per request that may run at once.

A graph reads and writes fixed tensors, so with graphs every running request borrows a lane (its cache, whose
block table the graphs read) for its lifetime; its KV blocks come from the pool, a held conversation's moving in
and out of the lane's table (`SequenceCache.load` / `detach`). Graphs are captured per lane (its decode and
verify steps) and per batch bucket B (one decode token for each of lanes 0..B-1); `batch_bucket` says which
bucket serves a step of a given set of lanes. Only the engine core's thread lends and takes back lanes.
"""
from __future__ import annotations

from ..cache.sequence import SequenceCache


def batch_buckets(lanes: int) -> tuple[int, ...]:
    """The batch sizes captured for `lanes` lanes: the powers of two below it, and itself (a step of n lanes
    replays the smallest bucket >= n; free lanes fill the rest)."""
    return tuple(sorted({b for b in (2, 4, 8, 16, 32, 64, 128) if b < lanes} | {lanes})) if lanes > 1 else ()


def batch_bucket(stepping: list[int], busy: set[int], buckets: tuple[int, ...]) -> int | None:
    """The smallest bucket B whose lanes 0..B-1 cover the lanes `stepping` this step and hold no other running
    sequence (a free lane's row computes a throw-away token into a cache nobody holds, which its next user resets);
    None when no bucket fits (a running lane in the way that is not stepping now: prefilling, or verifying)."""
    need = max(stepping) + 1
    step = set(stepping)
    for b in sorted(buckets):
        if b >= need and not any(i in busy and i not in step for i in range(b)):
            return b
    return None


class Lanes:
    """The lanes and which of them running requests hold. `take` gives the lowest free lane, so running
    sequences gather at the low lanes, which the small buckets cover."""

    def __init__(self, caches: list[SequenceCache]) -> None:
        self.caches = caches
        self._index = {id(c): i for i, c in enumerate(caches)}
        self._busy: set[int] = set()

    def __len__(self) -> int:
        return len(self.caches)

    def index(self, cache: SequenceCache) -> int | None:
        return self._index.get(id(cache))

    def busy(self) -> set[int]:
        return set(self._busy)

    def take(self) -> SequenceCache | None:
        """The lowest free lane's cache, or None when all are lent."""
        free = set(range(len(self.caches))) - self._busy
        if not free:
            return None
        lane = min(free)
        self._busy.add(lane)
        return self.caches[lane]

    def give(self, cache: SequenceCache) -> None:
        """Back to the free lanes (its blocks already given back). Its length goes to 0 at once: batch steps that
        cover a free lane write a throw-away token at its length, into the pool's scratch block. Its request's
        images (their embeddings on the device) go with it."""
        cache.length, cache.kept, cache.media = 0, None, None
        self._busy.discard(self._index[id(cache)])
