"""A benchmark drafter whose acceptance is set, not earned: it proposes the target's own greedy continuation
(learned from an earlier identical request), spoiled at a chosen rate.

With random weights (or a drafter not trained for the target) a drafter's guesses are noise, so speculative
throughput cannot be measured end to end: every round would keep none of its drafts. `ControlledDrafter` wraps the
real drafter, lets it run (its forwards, its KV, its graphs cost what they cost in a real run) and throws its
guesses away; what it proposes instead comes from a table of what the target produced after each context. A
first pass of a workload (the same prompts, greedy) fills the table; a second, measured pass drafts from it.

Acceptance is set per draft: `acceptance` a is accepted/drafted (`SpecStats.acceptance_rate`) with k drafts a
round under greedy verification, where a round keeps the leading run of right drafts. Each draft is right with
probability q independently, and after the first wrong one the rest are wrong too, so a round keeps j or more
drafts with probability q^j and E[kept] = sum_{j=1..k} q^j; q solves sum q^j / k = a. Reference figures:
a = 0.596 at k = 7 (the reference DFlash run, 1 + 7 x 0.596 = 5.17 tokens a round: q ~ 0.87) and a = 0.79 at
k = 3 (MTP3, 3.37 tokens a round: q ~ 0.89).

Output is unchanged (the target verifies every draft, so it stays lossless). Acceptance falls short of a where the
continuation is unknown (the first pass, a prompt not seen before, an output that diverged from the first pass's)
and under sampling (where the recorded tokens are one draw and a right draft is kept with the target's
probability of it, not always).
"""
from __future__ import annotations

import random
import threading
from collections import OrderedDict
from dataclasses import dataclass
from functools import cache

from ...cache.kv_pool import StoreSpec
from ...cache.sequence import SequenceCache
from ...cuda_graphs import BoundGraphs
from ...models.taps import Taps
from . import Drafter

# A position of a sequence is keyed by its length and its last CONTEXT tokens: cheap to hash, and two sequences
# of one length that end alike for this long continue alike in practice (same prompts, greedy).
CONTEXT = 16
# Sequences whose registration progress is remembered (least recently drafted dropped first); a dropped one
# starts afresh, which loses only the transitions of its next round.
MAX_SEQUENCES = 1024


@cache
def per_draft_rate(acceptance: float, k: int) -> float:
    """The q with sum_{j=1..k} q^j / k = acceptance (bisection: the sum rises from 0 at q = 0 to 1 at q = 1)."""
    if not 0.0 <= acceptance < 1.0:
        raise ValueError(f"acceptance must be in [0, 1), got {acceptance}")
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    lo, hi = 0.0, 1.0
    for _ in range(60):
        q = (lo + hi) / 2
        if sum(q ** j for j in range(1, k + 1)) / k < acceptance:
            lo = q
        else:
            hi = q
    return (lo + hi) / 2


def _key(length: int, context: list[int]) -> int:
    """The key of the position after a sequence of `length` tokens that ends in `context`."""
    return hash((length, *context[-CONTEXT:]))


@dataclass
class _Progress:
    """How far one sequence's history is registered: `source` is the history list last seen (the round loop
    grows it in place), `known` its positions registered."""

    source: list[int]
    known: int


class ControlledDrafter(Drafter):
    """Drafts the target's recorded greedy continuation, each draft right at a rate that makes the acceptance
    `acceptance` (see the module doc), while `inner` (the real drafter, or None) runs its own forwards.

    Every Drafter hook and attribute the round reads is forwarded to `inner`, which keeps `cache.draft` to itself;
    nothing else is (no `__getattr__`): a round loop that learned a new drafter method should fail here rather
    than reach the inner drafter's guesses past the control. The table grows by one entry per generated token
    (~100 bytes each) for the drafter's lifetime: it is a benchmark tool."""

    def __init__(self, inner: Drafter | None, acceptance: float, vocab_size: int, seed: int = 0) -> None:
        per_draft_rate(acceptance, 1)  # range check
        if vocab_size < 2:
            raise ValueError(f"vocab_size must be >= 2, got {vocab_size}")
        self.inner = inner
        self.acceptance = acceptance
        self.vocab_size = vocab_size
        self.rng = random.Random(seed)
        self.table: dict[int, int] = {}  # position key -> the token the target produced there
        self._progress: OrderedDict[int, _Progress] = OrderedDict()  # by id(cache)
        self._lock = threading.Lock()  # requests on several threads share the table, the RNG and the progress

    # ---- what the round reads of the real drafter --------------------------------------------------------------

    @property
    def reads_target_cache(self) -> bool:
        return self.inner is not None and getattr(self.inner, "reads_target_cache", False)

    @property
    def kv_store(self) -> tuple[str, StoreSpec] | None:
        return self.inner.kv_store if self.inner is not None else None

    @property
    def graphs(self) -> BoundGraphs | None:
        return self.inner.graphs if self.inner is not None else None

    def taps(self) -> Taps | None:
        return self.inner.taps() if self.inner is not None else None

    def prepare(self, cache: SequenceCache) -> None:
        """A request starts on `cache` (a new one, a reused lane's, a held conversation's next turn): its prompt
        is not the target's output, so what was registered for the cache's last history no longer continues."""
        if self.inner is not None:
            self.inner.prepare(cache)
        with self._lock:
            self._progress.pop(id(cache), None)

    def observe(self, cache: SequenceCache, ids: list[int], taps: Taps | None, next_token: int) -> None:
        if self.inner is not None:
            self.inner.observe(cache, ids, taps, next_token)
        with self._lock:  # the tokens output since the last proposal (the last round's, at a request's end)
            progress = self._progress.get(id(cache))
            if progress is not None:
                self._register(progress)

    # ---- learning and drafting ----------------------------------------------------------------------------------

    def _register(self, progress: _Progress) -> None:
        history = progress.source
        for end in range(progress.known, len(history)):
            self.table[_key(end, history[max(0, end - CONTEXT):end])] = history[end]
        progress.known = max(progress.known, len(history))

    def _learn(self, cache: SequenceCache, history: list[int]) -> None:
        """Record the transitions of `history` not recorded yet for this sequence. Every consecutive pair of a
        sequence's output is the target's own (greedy: its argmax); a request's first call also records the
        step from its prompt to its first token, but none inside the prompt, whose tokens the target did not
        choose (they could shadow its continuation of a shorter prompt). Within a request the round loop grows
        one history list in place; a copy that extends the last one seen continues it too."""
        progress = self._progress.get(id(cache))
        grown = progress is not None and len(history) >= progress.known and (
            history is progress.source or history[:progress.known] == progress.source[:progress.known])
        if progress is None or not grown:  # a new request: its prompt is not output
            progress = _Progress(history, max(0, len(history) - 1))
            self._progress[id(cache)] = progress
            if len(self._progress) > MAX_SEQUENCES:
                self._progress.popitem(last=False)
        progress.source = history
        self._progress.move_to_end(id(cache))
        self._register(progress)

    def _wrong(self, truth: int | None) -> int:
        if truth is None:
            return self.rng.randrange(self.vocab_size)
        return (truth + 1 + self.rng.randrange(self.vocab_size - 1)) % self.vocab_size

    def propose(self, cache: SequenceCache, history: list[int], k: int) -> list[int]:
        return self.propose_rows([cache], [history], [k])[0]

    def propose_rows(self, caches: list[SequenceCache], histories: list[list[int] | None],
                     ks: list[int]) -> list[list[int]]:
        """Host ids for each sequence. The inner drafter proposes first (all sequences in one call, as it would
        alone) and its guesses are dropped unread: a device tensor stays on the device (no host sync it would not
        have had), so its forward costs what it would. The round then copies these host ids to the device where
        it would have used the inner's tensor in place: K + 1 ids a row, a few microseconds."""
        if self.inner is not None:
            self.inner.propose_rows(caches, histories, ks)
        rows = zip(caches, histories, ks, strict=True)
        with self._lock:
            return [self._drafts(c, h, k) if h is not None else [] for c, h, k in rows]

    def _drafts(self, cache: SequenceCache, history: list[int], k: int) -> list[int]:
        self._learn(cache, history)
        if k < 1:
            return []
        q = per_draft_rate(self.acceptance, k)
        tail = history[-CONTEXT:]
        end = len(history)
        drafts: list[int] = []
        right = True
        for i in range(k):
            truth = self.table.get(_key(end + i, tail)) if right else None  # unknown past a wrong draft
            right = truth is not None and self.rng.random() < q
            token = truth if right else self._wrong(truth)
            drafts.append(token)
            tail.append(token)
        return drafts
