"""Capturing a CUDA graph of a step, shared by the model runner and the drafters that replay graphs."""
from __future__ import annotations

from collections.abc import Callable

import torch


def capture(fn: Callable[[], object], pool) -> tuple[torch.cuda.CUDAGraph, object]:
    """Run `fn` once on the default stream (first-call compilation, tile timing), once on a side stream (the
    allocator's warm-up that capture requires), then capture it into a graph whose memory comes from `pool`.
    Returns the graph and what the captured call returned (its static outputs)."""
    fn()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        out = fn()
    return graph, out
