"""CUDA graphs of the decode/verify step, captured once per step size for the engine's working cache and
replayed each step: one launch instead of the ~1,500 kernel launches (and their Python) of an eager step.

A graph reads its inputs from static buffers (token ids, positions) and writes to static outputs (logits, the
drafter's hidden states, the GDN inputs a verify step keeps for its commit), so it is bound to one cache's tensors:
the engine runs every request in one working cache and copies held conversations in and out of it. Sizes: T = 1
(plain decode) and T = K+1 (a verify step); a verify step with fewer drafts pads to K+1 (its extra positions
write KV past the sequence's end, which the next step overwrites, and roll back like rejected drafts). Anything
else (prefill chunks, other caches) runs eagerly through the model.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..cache.sequence import SequenceCache
from ..cuda_graphs import capture as capture_graph
from ..models.capture import Capture


@dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph
    ids: torch.Tensor  # [T] static input
    positions: torch.Tensor  # [T] static input
    logits: torch.Tensor  # [1 or T, vocab]
    capture: Capture | None  # static hidden states a drafter reads
    steps: object | None  # the StepStates a verify step keeps (static)


class GraphRunner:
    """The model's `forward`, replaying a captured graph where one fits the step."""

    def __init__(self, model, cache: SequenceCache, sizes: tuple[int, ...],
                 make_capture: Callable[[], Capture | None] | None = None) -> None:
        self.model, self.cache, self.sizes = model, cache, tuple(sorted(set(sizes)))
        self.device, self.spec = model.device, model.spec
        self._make_capture = make_capture
        self._graphs: dict[int, _Graph] = {}
        self._arange = torch.arange(max(self.sizes), device=self.device)
        self._pool = torch.cuda.graph_pool_handle()
        self.replays = 0

    @property
    def captured(self) -> tuple[int, ...]:
        return tuple(sorted(self._graphs))

    def new_cache(self, max_len: int) -> SequenceCache:
        return self.model.new_cache(max_len)

    def capture_all(self, progress: Callable[[int, int], None] | None = None) -> None:
        """Capture every size (the working cache must hold no sequence: warm-up runs write into it)."""
        for i, size in enumerate(self.sizes):
            self._graphs[size] = self._capture(size)
            if progress is not None:
                progress(i + 1, len(self.sizes))
        self.cache.reset()

    def _capture(self, size: int) -> _Graph:
        verify = size > 1
        ids = torch.zeros(size, dtype=torch.long, device=self.device)
        positions = self._arange[:size].clone()
        capture = self._make_capture() if self._make_capture is not None else None

        def step() -> torch.Tensor:
            self.cache.length = 0
            return self.model.forward(ids, self.cache, all_logits=verify, capture=capture, keep_steps=verify,
                                      positions=positions)

        with torch.inference_mode():
            graph, logits = capture_graph(step, self._pool)
        return _Graph(graph, ids, positions, logits, capture, self.cache.steps)

    def _pick(self, t: int, cache: SequenceCache, keep_steps: bool, capture: Capture | None) -> _Graph | None:
        if cache is not self.cache:
            return None
        if t == 1 and not keep_steps:
            g = self._graphs.get(1)
        elif keep_steps:
            size = next((s for s in self.sizes if s >= t and s > 1), None)
            g = self._graphs.get(size) if size and cache.length + size <= cache.capacity else None
        else:
            return None  # a short prefill chunk
        if g is None or (capture is None) != (g.capture is None):
            return None
        return g

    def forward(self, ids: torch.Tensor, cache: SequenceCache, all_logits: bool = False,
                capture: Capture | None = None, keep_steps: bool = False,
                positions: torch.Tensor | None = None) -> torch.Tensor:
        t = ids.shape[0]
        g = self._pick(t, cache, keep_steps, capture) if positions is None else None
        if g is None:
            return self.model.forward(ids, cache, all_logits, capture, keep_steps, positions)
        size, start = g.ids.shape[0], cache.length
        g.ids[:t].copy_(ids)  # padding positions keep earlier ids: any token is fine there
        torch.add(self._arange[:size], start, out=g.positions)
        g.graph.replay()
        self.replays += 1
        cache.length = start + t
        cache.steps = g.steps
        if capture is not None:
            kept = g.capture.first(t)
            capture.layers, capture.hidden = kept.layers, kept.hidden
        return g.logits[:t] if size > 1 else g.logits
