"""Held sequences: finished conversations whose KV cache and recurrent state are kept (their KV blocks stay in
the pool, or their KV goes to host memory with the host tier: `host_kv_mib`, `host_state_slots`), so the next
turn (which resends the whole conversation) prefills only its new tokens. A dropped one gives its blocks back;
with the disk tier (`disk_tier.py`) an evicted one is written to disk first, and read back (`read`) for a request
that continues it."""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from .sequence import SequenceCache
from .state_slots import GDNState

if TYPE_CHECKING:
    from .disk_tier import DiskTier, Loaded


@dataclass
class HeldSequence:
    tokens: list[int]  # exactly the tokens in the cache
    cache: SequenceCache
    # Recurrent states taken during the prompt (hybrid models), by position: the start of the last message and
    # the end of the prompt, so a client that edits its last message or drops the reply still reuses most.
    checkpoints: dict[int, GDNState] = field(default_factory=dict)


def common_prefix(a, b) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


def reusable(tokens, checkpoints, recurrent: bool, prompt: list[int]) -> int:
    """How many leading tokens of `prompt` a conversation of `tokens` can serve.

    At least one prompt token is always left to run (its logits start the generation). Attention KV can be cut
    anywhere; a recurrent state exists only where it was taken: at the end of the tokens or at a checkpoint.
    """
    common = min(common_prefix(tokens, prompt), len(prompt) - 1)
    if not recurrent or common == len(tokens):
        return common
    return max((pos for pos in checkpoints if pos <= common), default=0)


def reusable_tokens(held: HeldSequence, prompt: list[int]) -> int:
    return reusable(held.tokens, held.checkpoints, held.cache.states is not None, prompt)


def state_copies(held: HeldSequence) -> int:
    """Recurrent-state copies a held sequence keeps: its final state and its checkpoints (none without GDN)."""
    return 0 if held.cache.states is None else 1 + len(held.checkpoints)


class HeldSequences:
    """An LRU of at most `capacity` held sequences; taking one removes it (a running sequence is never shared).
    With budgets (the host tier), their KV stays within `kv_bytes` and their recurrent-state copies within
    `state_copies`: the oldest go first, and a sequence that alone exceeds a budget is not held. With a disk
    tier, those that go are written to it, and `read` loads its files."""

    def __init__(self, capacity: int, kv_bytes: int = 0, state_copies: int = 0, disk: DiskTier | None = None
                 ) -> None:
        self.capacity, self.kv_bytes, self.state_copies = capacity, kv_bytes, state_copies
        self.disk = disk
        self._items: OrderedDict[int, HeldSequence] = OrderedDict()
        self._next = 0

    def __len__(self) -> int:
        return len(self._items)

    def __iter__(self) -> Iterator[HeldSequence]:
        """Oldest first."""
        return iter(list(self._items.values()))

    def best(self, prompt: list[int]) -> tuple[HeldSequence | None, int]:
        """The held sequence that serves the most of `prompt`, and how many tokens (None, 0: none serves any)."""
        best, best_n = None, 0
        for held in self._items.values():
            n = reusable_tokens(held, prompt)
            if n > best_n:
                best, best_n = held, n
        return best, best_n

    def read(self, prompt: list[int], served: Callable[[], int]) -> Future | None:
        """A file of the disk tier that serves more of `prompt` than `served()` (what memory serves), read into
        host memory on the tier's reader thread: a future of the conversation (`hold_loaded` holds it), or of
        None; None when there is no disk tier or holding is off."""
        if self.disk is None or self.capacity <= 0:
            return None
        return self.disk.read(prompt, served)

    def hold_loaded(self, loaded: Loaded) -> None:
        """Hold a conversation `DiskTier.load` read (the newest), unless one of the same tokens is held already."""
        tokens, kv, states, checkpoints = loaded
        if not any(h.tokens == tokens for h in self._items.values()):
            self.put(HeldSequence(tokens, SequenceCache(kv=kv, states=states, length=len(tokens)), checkpoints))

    def touch(self, held: HeldSequence) -> None:
        """Make it the newest (a request shares its tokens)."""
        self.take(held)
        self._items[self._next] = held
        self._next += 1

    def take(self, held: HeldSequence) -> None:
        """Remove it without giving its blocks back (a running sequence takes them over)."""
        key = next(k for k, h in self._items.items() if h is held)
        del self._items[key]

    def drop_oldest(self, keep: HeldSequence | None = None) -> bool:
        """Drop the oldest held sequence other than `keep` (its blocks go back to the pool); False when none."""
        key = next((k for k, h in self._items.items() if h is not keep), None)
        if key is None:
            return False
        self._evict(self._items.pop(key))
        return True

    def put(self, held: HeldSequence) -> None:
        if self.capacity <= 0:
            held.cache.release()
            return
        self._items[self._next] = held
        self._next += 1
        while self._items and self._over():
            self._evict(self._items.popitem(last=False)[1])

    def _evict(self, held: HeldSequence) -> None:
        """A held sequence leaves memory: written to the disk tier first (its copies taken before its blocks go
        back), then its blocks go back to the pool."""
        try:
            if self.disk is not None:
                self.disk.spill(held.tokens, held.cache, held.checkpoints)
        finally:
            held.cache.release()

    def persist(self) -> None:
        """Write every held sequence to the disk tier and wait for the files (the engine closes); they stay
        held."""
        if self.disk is None:
            return
        for held in self._items.values():
            self.disk.spill(held.tokens, held.cache, held.checkpoints, wait=True)
        self.disk.flush()

    def _over(self) -> bool:
        held = self._items.values()
        return (len(self._items) > self.capacity
                or 0 < self.kv_bytes < sum(h.cache.kv.nbytes for h in held)
                or 0 < self.state_copies < sum(state_copies(h) for h in held))

    def clear(self) -> None:
        """Forget every held sequence, the disk tier's files included (they stay on disk for later runs): the
        next prompt is prefilled whole."""
        while self._items:
            self._items.popitem(last=False)[1].cache.release()
        if self.disk is not None:
            self.disk.forget()
