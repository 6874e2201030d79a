"""Capturing CUDA graphs of steps: the model runner's, and the drafters' (bound to a sequence's block table)."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

# A drafter's step over a sequence's newest tokens replays a graph when it takes up to this many: a verify round's
# kept tokens (K + 1 <= 8), or a short prompt's.
MAX_GRAPH_TOKENS = 8


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


@dataclass
class _Bound:
    graph: torch.cuda.CUDAGraph
    bound: torch.Tensor
    inputs: tuple[torch.Tensor, ...]
    outputs: tuple[torch.Tensor, ...]


class BoundGraphs:
    """CUDA graphs of a drafter's steps, one per key, bound to one tensor (the block table of the sequence whose
    drafter KV they write: a lane's serves every request in it): when another comes, every graph is captured
    again. The graph runner captures a lane's before any request runs in it (`GraphRunner.capture_all`); a key it
    did not foresee is captured on first use.
    `fn(*inputs)` takes device tensors and returns a tuple of tensors; host bookkeeping is the caller's."""

    def __init__(self) -> None:
        self._graphs: dict[object, _Bound] = {}
        self._pool = torch.cuda.graph_pool_handle()
        self.captures = 0  # graphs captured so far, recaptures included

    @property
    def keys(self) -> frozenset:
        return frozenset(self._graphs)

    def replay(self, key, bound: torch.Tensor, fn: Callable[..., tuple], *inputs: torch.Tensor) -> tuple:
        g = self._graphs.get(key)
        if g is None or g.bound is not bound:
            if any(other.bound is not bound for other in self._graphs.values()):
                self._graphs.clear()  # they write another sequence's tensors
            statics = tuple(x.clone() for x in inputs)
            graph, outputs = capture(lambda: fn(*statics), self._pool)  # the warm-up runs write what replays do
            g = self._graphs[key] = _Bound(graph, bound, statics, outputs)
            self.captures += 1
        for static, x in zip(g.inputs, inputs, strict=True):
            static.copy_(x)
        g.graph.replay()
        return g.outputs
