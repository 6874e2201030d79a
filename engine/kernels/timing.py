"""Device time of a kernel call as a captured decode step pays it: replayed inside a CUDA graph (no host launch
cost, which per-call timing of a Triton kernel inflates by tens of microseconds) and, when asked, with L2
flushed before each call so its weights come from memory as they do in a whole step."""
from __future__ import annotations

from collections.abc import Callable

import torch


def median_ms(fn: Callable[[], object], reps: int, warmup: int = 0) -> float:
    """Median device time of `fn` over `reps` runs (CUDA events around each run)."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    times.sort()
    return times[len(times) // 2]


def graph_ms(fn: Callable[[], object], calls: int = 32, reps: int = 50, flush_l2: bool = False) -> float:
    """Median device time per call of `fn` over `reps` replays of a graph of `calls` calls. With flush_l2 every
    call follows a write of twice the L2 size, whose own time (a graph of the writes alone) is subtracted."""
    scratch = None
    if flush_l2:
        l2 = torch.cuda.get_device_properties(torch.cuda.current_device()).L2_cache_size
        try:
            scratch = torch.empty(2 * l2, dtype=torch.uint8, device="cuda")
        except torch.OutOfMemoryError:
            scratch = None  # a full card: time without the flush rather than fail the launch
    for _ in range(2):
        fn()
    torch.cuda.synchronize()

    def capture(with_fn: bool) -> torch.cuda.CUDAGraph:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(calls):
                if scratch is not None:
                    scratch.fill_(1)
                if with_fn:
                    fn()
        return graph

    total = median_ms(capture(True).replay, reps, warmup=1)
    flush = median_ms(capture(False).replay, reps, warmup=1) if scratch is not None else 0.0
    return (total - flush) / calls


def candidate_ms(fn: Callable[[], object], calls: int = 8, reps: int = 10) -> float:
    """A kernel candidate's `graph_ms` with L2 flushed, as the choosers time them; infinite for a candidate this
    GPU cannot compile or launch (too much shared memory, say), so the choice passes over it. Running out of
    memory is not the candidate's fault, and a CUDA error (an illegal address, say) leaves the device unusable for
    every candidate after it, which would all time infinite and leave an untimed first one chosen: both
    propagate."""
    try:
        return graph_ms(fn, calls=calls, reps=reps, flush_l2=True)
    except Exception as e:  # noqa: BLE001 - Triton and the driver raise several types (OutOfResources, compile errors)
        if isinstance(e, torch.cuda.OutOfMemoryError) or "CUDA error" in str(e) or \
                type(e).__name__ == "AcceleratorError":
            raise
        return float("inf")
