"""The kernels of an eager prefill chunk, run once at load on a GPU.

A prompt longer than the graphed prefill size runs eagerly (`runner.py`): on a fresh process its first chunk
compiled the Triton kernels it launches, ran fla-core's autotuning and loaded what the disk caches held, seconds
that the request's time to first token paid. The engine runs such chunks at load instead, on a lane emptied
after them, so the first prompt finds them ready, and Triton's on-disk cache (with fla-core's autotune results in
it) makes the next process's warm-up cheap. None runs on the CPU: its kernels are one library, built once into the
cache dir (`kernels/cpu_build.py`) whatever a prompt's length, and a warm-up would only lengthen its load."""
from __future__ import annotations

from collections.abc import Callable

import torch

from ..cache.sequence import SequenceCache
from .drafting import Drafter

# tokens past the graphed prefill size of the shorter chunk: a prompt of a few hundred tokens, or a long prompt's
# last chunk
PAST_GRAPHED = 201


def warmup_chunks(graphed: int, chunk: int, room: int) -> list[int]:
    """The eager prefill chunks to run at load, in order on one sequence: a full chunk (`chunk` tokens, a long
    prompt's first ones) from position 0, then a shorter one past the graphed size `graphed`, over the first one's
    KV as a long prompt's later chunks run. The shorter one's length is no multiple of 16: Triton compiles a
    variant of a kernel for each divisibility by 16 of its integer arguments, and the two lengths take both.
    `room`: tokens the sequence may hold. [] when every chunk runs as graphed pieces."""
    full = min(chunk, room)
    if full <= graphed:
        return []
    short = min(graphed + PAST_GRAPHED, full - 1, room - full)
    if short % 16 == 0:
        short -= 1
    return [full, short] if short > graphed else [full]


def warm_prefill(target, drafter: Drafter | None, cache: SequenceCache, chunks: list[int],
                 progress: Callable[[int], None] | None = None) -> None:
    """Run `chunks` as the engine core runs a prompt's eager chunks: through `target` (the model, or the graph
    runner in front of it) on `cache`, which holds blocks for them all, with the drafter's taps and its observation
    of each chunk. What they write is thrown away: the caller empties the cache. `progress(i)` after chunk i."""
    with torch.inference_mode():
        cache.reset()
        if drafter is not None:
            drafter.prepare(cache)
        for i, n in enumerate(chunks, 1):
            taps = drafter.taps() if drafter is not None else None
            target.forward(torch.zeros(n, dtype=torch.long, device=target.device), cache, taps=taps)
            if drafter is not None:
                drafter.observe(cache, [0] * n, taps, 0)
            if progress is not None:
                progress(i)


class LoadProgress:
    """The GPU's load steps as one progress report, `report(done, total)`: the graph captures (which count
    their own), then `later` more (the warm-up's chunks)."""

    def __init__(self, report: Callable[[int, int], None] | None, later: int) -> None:
        self.report, self.later, self.captures = report, later, 0

    def captured(self, done: int, total: int) -> None:
        self.captures = total
        if self.report is not None:
            self.report(done, total + self.later)

    def warmed(self, done: int) -> None:
        if self.report is not None:
            self.report(self.captures + done, self.captures + self.later)
