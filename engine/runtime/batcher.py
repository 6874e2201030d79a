"""Concurrent sequences sharing the model: each model call takes one lock, and the plain decode steps (one token,
nothing kept for a drafter) that several sequences queue meanwhile run as one batched step, the weights read once
for all of them. Whoever gets the lock runs every step queued by then; the others find their logits ready."""
from __future__ import annotations

import threading
from dataclasses import dataclass

import torch

from ..cache.sequence import SequenceCache
from ..models.capture import Capture


@dataclass(eq=False)
class _Queued:
    ids: torch.Tensor
    cache: SequenceCache
    logits: torch.Tensor | None = None
    error: BaseException | None = None


class StepBatcher:
    """The model's `forward` (what the generation loop calls), safe to call from several request threads."""

    def __init__(self, model) -> None:
        self.model, self.device, self.spec = model, model.device, model.spec
        self._model_lock = threading.Lock()
        self._queue_lock = threading.Lock()
        self._queued: list[_Queued] = []
        self.batched_steps = 0  # steps that ran more than one sequence
        self.largest_batch = 1

    def new_cache(self, max_len: int) -> SequenceCache:
        return self.model.new_cache(max_len)

    def forward(self, ids: torch.Tensor, cache: SequenceCache, all_logits: bool = False,
                capture: Capture | None = None, keep_steps: bool = False,
                positions: torch.Tensor | None = None) -> torch.Tensor:
        if ids.shape[0] != 1 or all_logits or capture is not None or keep_steps or positions is not None:
            with self._model_lock:  # prefill chunks and verify steps run alone
                return self.model.forward(ids, cache, all_logits, capture, keep_steps, positions)
        mine = _Queued(ids, cache)
        with self._queue_lock:
            self._queued.append(mine)
        with self._model_lock:
            if mine.logits is None and mine.error is None:  # no earlier holder took it: run the queue
                with self._queue_lock:
                    batch, self._queued = self._queued, []
                self._run(batch)
        if mine.error is not None:
            raise mine.error
        return mine.logits

    def _run(self, batch: list[_Queued]) -> None:
        try:
            if len(batch) == 1:
                outs = [self.model.forward(batch[0].ids, batch[0].cache)]
            else:
                logits = self.model.forward_batch(torch.cat([q.ids for q in batch]), [q.cache for q in batch])
                outs = [logits[i:i + 1] for i in range(len(batch))]
                self.batched_steps += 1
                self.largest_batch = max(self.largest_batch, len(batch))
        except BaseException as e:  # noqa: BLE001 - every sequence of the step sees the step's failure
            for q in batch:
                q.error = e
            return
        for q, out in zip(batch, outs, strict=True):
            q.logits = out
