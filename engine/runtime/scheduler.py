"""The scheduler: which requests wait and which run, and what each running one does in the next step.

Admission is in arrival order: up to `max_running` requests run, up to `max_pending` more wait, the rest are
refused at once (Overloaded). A waiting request starts when `admit` finds it a place (a cache and its KV
blocks). Each step's plan gives every decoding request its row first (one token, or its pending token and its
drafts), then spends what is left of the step's token budget on prefill chunks, oldest request first, so a long
prompt prefills in chunks between the running requests' tokens instead of stalling them."""
from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from ..errors import NinferError
from .sequence import Sequence

MIN_CHUNK = 16  # a prefilling request gets at least this many tokens a step, however full the step is


class Overloaded(NinferError):
    """The pending queue is full; the caller should retry later (HTTP 429/529 with Retry-After)."""

    exit_code = 2


class NoRoom(Exception):  # noqa: N818 - a condition the core handles, not an error a caller sees
    """The KV pool has no block for an elastic request's next tokens (`Engine._grow`): the core preempts."""


@dataclass(eq=False)
class Work:
    """One request's rows in a step."""

    seq: Sequence
    ids: list[int]  # the tokens fed (a verify step: the pending token; its drafts are in `drafts`)
    prefill: bool
    drafts: list[int] | torch.Tensor = field(default_factory=list)
    seen: int = 0  # a prefill chunk's tokens the drafter has observed already (graphed pieces but the last)
    keep: bool = False  # a verify step: every row's logits count, its recurrent inputs kept until the commit

    @property
    def tokens(self) -> int:
        return len(self.ids) + len(self.drafts)



class Scheduler:
    def __init__(self, max_running: int, max_pending: int, step_tokens: int) -> None:
        self.max_running, self.max_pending, self.step_tokens = max_running, max_pending, step_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.lock = threading.Condition()  # guards `waiting` (other threads add); the loop thread alone runs

    def add(self, seq: Sequence) -> None:
        """Queue a request, or raise Overloaded when the queue is full (call under `lock`)."""
        free = self.max_running - len(self.running)
        if len(self.waiting) >= max(0, free) + self.max_pending:
            queued = max(0, len(self.waiting) - max(0, free))
            raise Overloaded(f"the server is busy: {len(self.running)} running and {queued} queued requests "
                             f"(max_pending_requests = {self.max_pending})",
                             hint="retry in a few seconds, or raise max_pending_requests in the profile")
        self.waiting.append(seq)

    @property
    def pending(self) -> int:
        """Requests that wait for a running place (those about to be admitted by the next step count here)."""
        return len(self.waiting)

    def admit(self, start: Callable[[Sequence], bool]) -> list[Sequence]:
        """Start waiting requests in arrival order while places are free and `start` finds one room (False:
        not now; the rest wait behind it). A request whose held conversation is still being read from disk
        (`Sequence.loading`) is passed over and keeps its place: the requests behind it need not wait for the
        read. Returns those started."""
        started, passed = [], 0  # passed: the queue's first requests, each still reading
        while len(self.running) < self.max_running:
            with self.lock:  # other threads only append: the loop thread, this one, alone removes
                if passed >= len(self.waiting):
                    break
                seq = self.waiting[passed]
            if seq.loading is not None and not seq.loading.done():
                passed += 1
                continue
            if not start(seq):
                break
            with self.lock:
                del self.waiting[passed]
                self.running.append(seq)
            started.append(seq)
        return started

    def plan(self, propose: Callable[[list[Sequence]], list[tuple[list[int] | torch.Tensor, bool]]]
             ) -> list[Work]:
        """The next step's work. `propose(seqs)` gives the decoding requests' drafts (all at once: a drafter's
        forward serves them together) and whether each one's row is a verify row."""
        decoding = [seq for seq in self.running if not seq.prefilling]
        works = [Work(seq, [seq.pending], False, drafts, keep=verify)
                 for seq, (drafts, verify) in zip(decoding, propose(decoding) if decoding else [], strict=True)]
        left = self.step_tokens - sum(w.tokens for w in works)
        for seq in self.running:
            if seq.prefilling:
                start = seq.cache.length
                n = min(seq.next_stop() - start, max(left, MIN_CHUNK))
                works.append(Work(seq, seq.fed_ids[start:start + n], True))
                left -= n
                if left <= 0:
                    break
        return works

    def requeue(self, seq: Sequence) -> None:
        """A preempted request waits again, first in the queue: it came before every request still waiting."""
        with self.lock:
            self.running.remove(seq)
            self.waiting.appendleft(seq)

    def leave(self, seq: Sequence) -> None:
        with self.lock:
            if seq in self.running:
                self.running.remove(seq)
            elif seq in self.waiting:
                self.waiting.remove(seq)
