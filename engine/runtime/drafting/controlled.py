"""A benchmark drafter whose acceptance is set, not earned: it proposes the target's own greedy continuation
(learned from an earlier identical request), spoiled at a chosen rate.

With random weights (or a drafter not trained for the target) a drafter's guesses are noise, so speculative
throughput cannot be measured end to end: every round would keep none of its drafts. `ControlledDrafter` wraps the
real drafter, lets it run (its forwards, its KV, its graphs cost what they cost in a real run) and throws its
guesses away; what it proposes instead comes from a table of what the target produced after each context. A
first pass of a workload (the same prompts, greedy) fills the table; a second, measured pass drafts from it.

Acceptance is set per draft: `acceptance` a is accepted/drafted (`SpecStats.acceptance_rate`) under greedy
verification, where a round keeps the leading run of right drafts. Each sequence's rounds keep a run of right drafts
whose lengths add up to a x the drafts made so far (the remainder carried to the next round: with k = 7 and
a = 0.596, runs of 4 and now and then 5), so a request's acceptance is a within one draft however few rounds it
runs: drawn at random per draft it spread by +-0.08 over the ~20 rounds of a 96-token benchmark request, more than
the differences a concurrency benchmark compares. Throughput follows the mean tokens a round (1 + a x k: 5.17 for
the reference DFlash run at a = 0.596, k = 7; 3.37 for MTP3 at a = 0.79, k = 3), which a fixed run length keeps.

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


def check_rate(acceptance: float) -> None:
    if not 0.0 <= acceptance < 1.0:
        raise ValueError(f"acceptance must be in [0, 1), got {acceptance}")


def _key(length: int, context: list[int]) -> int:
    """The key of the position after a sequence of `length` tokens that ends in `context`."""
    return hash((length, *context[-CONTEXT:]))


@dataclass
class _Progress:
    """How far one sequence's history is registered: `source` is the history list last seen (the round loop
    grows it in place), `known` its positions registered."""

    source: list[int]
    known: int
    owed: float = 0.0  # right drafts owed to the rate (a x drafted - right so far), carried between rounds


class ControlledDrafter(Drafter):
    """Drafts the target's recorded greedy continuation, each draft right at a rate that makes the acceptance
    `acceptance` (see the module doc), while `inner` (the real drafter, or None) runs its own forwards.

    Every Drafter hook and attribute the round reads is forwarded to `inner`, which keeps `cache.draft` to itself;
    nothing else is (no `__getattr__`): a round loop that learned a new drafter method should fail here rather
    than reach the inner drafter's guesses past the control. The table grows by one entry per generated token
    (~100 bytes each) for the drafter's lifetime: it is a benchmark tool."""

    def __init__(self, inner: Drafter | None, acceptance: float, vocab_size: int, seed: int = 0) -> None:
        check_rate(acceptance)
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

    def _learn(self, cache: SequenceCache, history: list[int]) -> _Progress:
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
        return progress

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
        progress = self._learn(cache, history)
        if k < 1:
            return []
        owed = progress.owed + self.acceptance * k
        right = min(k, int(owed + 0.5))
        progress.owed = owed - right  # a truth not recorded yet is not made up for later
        tail = history[-CONTEXT:]
        end = len(history)
        drafts: list[int] = []
        ok = True  # every draft so far is right
        for i in range(k):
            truth = self.table.get(_key(end + i, tail)) if ok else None  # unknown past a wrong draft
            ok = truth is not None and i < right
            token = truth if ok else self._wrong(truth)
            drafts.append(token)
            tail.append(token)
        return drafts
