"""Capturing CUDA graphs of steps: the model runner's, and the drafters' (bound to a sequence's block table)."""
from __future__ import annotations

from collections import OrderedDict
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
    """CUDA graphs of a drafter's steps, one per key and bound tensor (the block table of the sequence whose
    drafter KV they write: a lane's serves every request in it). Up to `max_bound` tensors keep their graphs (the
    graph runner sets it to its lane count, so each lane keeps its own); one more drops the least recently used
    tensor's. The graph runner captures a lane's before any request runs in it (`GraphRunner.capture_all`); a key
    it did not foresee is captured on first use.
    `fn(*inputs)` takes device tensors and returns a tuple of tensors; host bookkeeping is the caller's."""

    def __init__(self, max_bound: int = 1) -> None:
        self.max_bound = max_bound
        self._sets: OrderedDict[int, dict[object, _Bound]] = OrderedDict()  # id(bound) -> key -> graph
        self._pool = torch.cuda.graph_pool_handle()
        self.captures = 0  # graphs captured so far, recaptures included

    @property
    def keys(self) -> frozenset:
        """The keys captured for the most recently used bound tensor."""
        return frozenset(next(reversed(self._sets.values()), {}))

    def replay(self, key, bound: torch.Tensor, fn: Callable[..., tuple], *inputs: torch.Tensor) -> tuple:
        graphs = self._sets.get(id(bound))
        if graphs is None or any(g.bound is not bound for g in graphs.values()):  # an id reused by a new tensor
            graphs = self._sets[id(bound)] = {}
            while len(self._sets) > self.max_bound:
                self._sets.popitem(last=False)
        self._sets.move_to_end(id(bound))
        g = graphs.get(key)
        if g is None:
            statics = tuple(x.clone() for x in inputs)
            graph, outputs = capture(lambda: fn(*statics), self._pool)  # the warm-up runs write what replays do
            g = graphs[key] = _Bound(graph, bound, statics, outputs)
            self.captures += 1
        for static, x in zip(g.inputs, inputs, strict=True):
            static.copy_(x)
        g.graph.replay()
        return g.outputs
