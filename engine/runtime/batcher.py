"""Concurrent sequences sharing the model: each model call takes one lock, and the plain decode steps (one token,
nothing kept for a drafter) that several sequences queue meanwhile run as one batched step, the weights read once
for all of them. One queued sequence at a time runs the queue; the others wait on the queue's condition (never on
the model lock) and go on as soon as their logits are ready, so they can queue their next step while the runner
of the next one waits for them. `model` is the model itself (eager steps) or the CUDA-graph runner, which
replays a batch bucket's graph."""
from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from ..cache.kv_pool import KVPool
from ..cache.sequence import SequenceCache
from ..models.capture import Capture


@dataclass(eq=False)
class _Queued:
    ids: torch.Tensor
    cache: SequenceCache
    logits: torch.Tensor | None = None
    error: BaseException | None = None

    @property
    def done(self) -> bool:
        return self.logits is not None or self.error is not None


class StepBatcher:
    """The model's `forward` (what the generation loop calls), safe to call from several request threads."""

    def __init__(self, model) -> None:
        self.model, self.device, self.spec = model, model.device, model.spec
        self._model_lock = threading.Lock()
        self._queue_lock = threading.Condition()  # guards the queue, `_running` and the items' results
        self._queued: list[_Queued] = []
        self._running = False  # a sequence is running the queue
        self._stepped: dict[int, float] = {}  # id(cache) -> when its last plain step was launched
        self._step_s = 0.0  # how long the last plain step took (the latest one known to have ended, on a GPU)
        self._timing = _DeviceTiming() if self.device.type == "cuda" else None
        self.batched_steps = 0  # steps that ran more than one sequence
        self.largest_batch = 1

    def new_cache(self, max_len: int, pool: KVPool | None = None) -> SequenceCache:
        return self.model.new_cache(max_len, pool)

    def prefill_piece(self, tokens: int) -> int:
        """The model's step size for a prefill chunk: the graph runner's pieces, or 0 (one eager step)."""
        return self.model.prefill_piece(tokens)

    def forward(self, ids: torch.Tensor, cache: SequenceCache, all_logits: bool = False,
                capture: Capture | None = None, keep_steps: bool = False,
                positions: torch.Tensor | None = None) -> torch.Tensor:
        if ids.shape[0] != 1 or all_logits or capture is not None or keep_steps or positions is not None:
            with self._model_lock:  # prefill chunks and verify steps run alone
                return self.model.forward(ids, cache, all_logits, capture, keep_steps, positions)
        mine = _Queued(ids, cache)
        with self._queue_lock:
            self._queued.append(mine)
            self._queue_lock.notify_all()
            while self._running and not mine.done:
                self._queue_lock.wait()
            run = not mine.done
            self._running = self._running or run
        if run:  # no runner took it: run the queue
            try:
                with self._model_lock:
                    batch = self._gather()
                    self._run(batch)
            finally:
                with self._queue_lock:
                    self._running = False
                    self._queue_lock.notify_all()
        if mine.error is not None:
            raise mine.error
        return mine.logits

    @contextmanager
    def alone(self) -> Iterator[None]:
        """Hold the model meanwhile: no step runs (a graph runner's batch steps write into free lanes, so a lane
        is filled for its new sequence only while none runs)."""
        with self._model_lock:
            yield

    def leave(self, cache: SequenceCache) -> None:
        """The sequence of `cache` steps no more: the next steps do not wait for it."""
        with self._queue_lock:
            self._stepped.pop(id(cache), None)

    def _gather(self) -> list[_Queued]:
        """The queued steps, after a wait for the sequences that stepped lately and have not queued again yet.
        In phase, each spends a moment on the host between two steps, and without the wait two sequences would
        take the lock in turn and never share a step. Out of phase (a sequence that just started decoding, or
        one whose step ran without it), a sequence queues up to a few steps later: its last step was launched
        ahead, and others may run before it. Waiting for it brings it into phase, where running without it would
        keep it out (the others' steps and its own alternate; on CUDA graphs a step of the others cannot even
        replay the batch bucket that covers its lane, so their lanes' graphs replay one after another). Hence
        a wait of up to three step-times. A sequence that stops stepping without `leave` (or whose client stops
        reading) is not waited for once its last step is four step-times old."""
        now = time.perf_counter()
        deadline = now + min(0.1, 3 * self._step_s + 0.0005)
        with self._queue_lock:  # (`leave` changes `_stepped` from other threads)
            self._stepped = {k: t for k, t in self._stepped.items() if now - t < 4 * self._step_s + 0.01}
            while set(self._stepped) - {id(q.cache) for q in self._queued}:
                left = deadline - time.perf_counter()
                if left <= 0:
                    break
                self._queue_lock.wait(left)
            batch, self._queued = self._queued, []
        return batch

    def _run(self, batch: list[_Queued]) -> None:
        start = time.perf_counter()
        events = self._timing.start() if self._timing is not None else None
        try:
            if len(batch) == 1:
                outs = [self.model.forward(batch[0].ids, batch[0].cache)]
            else:
                logits = self.model.forward_batch(torch.cat([q.ids for q in batch]), [q.cache for q in batch])
                outs = [logits[i:i + 1] for i in range(len(batch))]
                self.batched_steps += 1
                self.largest_batch = max(self.largest_batch, len(batch))
        except BaseException as e:  # noqa: BLE001 - every sequence of the step sees the step's failure
            with self._queue_lock:
                for q in batch:
                    q.error = e
            return
        end = time.perf_counter()
        if self._timing is None:
            self._step_s = end - start
        else:
            self._timing.stop(events)
            self._step_s = self._timing.seconds
        with self._queue_lock:
            for q, out in zip(batch, outs, strict=True):
                q.logits = out
                self._stepped[id(q.cache)] = end
            self._queue_lock.notify_all()


class _DeviceTiming:
    """How long the latest finished step took on the device, read without waiting for a step: a GPU step returns
    at launch (its sequences launch their next steps before they read its tokens), so each step's events are
    read once a later step finds them done."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self._open: deque[tuple[torch.cuda.Event, torch.cuda.Event]] = deque(maxlen=8)

    def start(self) -> torch.cuda.Event:
        while self._open and self._open[0][1].query():
            begin, end = self._open.popleft()
            self.seconds = begin.elapsed_time(end) / 1e3
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def stop(self, begin: torch.cuda.Event) -> None:
        end = torch.cuda.Event(enable_timing=True)
        end.record()
        self._open.append((begin, end))
