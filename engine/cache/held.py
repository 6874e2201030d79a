"""Held sequences: finished conversations whose KV cache and recurrent state are kept (their KV blocks stay in
the pool, or their KV goes to host memory with the host tier: `host_kv_mib`, `host_state_slots`), so the next
turn (which resends the whole conversation) prefills only its new tokens. A dropped one gives its blocks back."""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass, field

from .sequence import SequenceCache
from .state_slots import GDNState


@dataclass
class HeldSequence:
    tokens: list[int]  # exactly the tokens in the cache
    cache: SequenceCache
    # Recurrent states taken during the prompt (hybrid models), by position: the start of the last message and
    # the end of the prompt, so a client that edits its last message or drops the reply still reuses most.
    checkpoints: dict[int, GDNState] = field(default_factory=dict)


def common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


def reusable_tokens(held: HeldSequence, prompt: list[int]) -> int:
    """How many leading tokens of `prompt` the held sequence can serve.

    At least one prompt token is always left to run (its logits start the generation). Attention KV can be cut
    anywhere; a recurrent state exists only where it was taken: at the end of the held tokens or at a checkpoint.
    """
    common = min(common_prefix(held.tokens, prompt), len(prompt) - 1)
    if held.cache.states is None or common == len(held.tokens):
        return common
    return max((pos for pos in held.checkpoints if pos <= common), default=0)


def state_copies(held: HeldSequence) -> int:
    """Recurrent-state copies a held sequence keeps: its final state and its checkpoints (none without GDN)."""
    return 0 if held.cache.states is None else 1 + len(held.checkpoints)


class HeldSequences:
    """An LRU of at most `capacity` held sequences; taking one removes it (a running sequence is never shared).
    With budgets (the host tier), their KV stays within `kv_bytes` and their recurrent-state copies within
    `state_copies`: the oldest go first, and a sequence that alone exceeds a budget is not held."""

    def __init__(self, capacity: int, kv_bytes: int = 0, state_copies: int = 0) -> None:
        self.capacity, self.kv_bytes, self.state_copies = capacity, kv_bytes, state_copies
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
        self._items.pop(key).cache.release()
        return True

    def put(self, held: HeldSequence) -> None:
        if self.capacity <= 0:
            held.cache.release()
            return
        self._items[self._next] = held
        self._next += 1
        while self._items and self._over():
            self._items.popitem(last=False)[1].cache.release()

    def _over(self) -> bool:
        held = self._items.values()
        return (len(self._items) > self.capacity
                or 0 < self.kv_bytes < sum(h.cache.kv.nbytes for h in held)
                or 0 < self.state_copies < sum(state_copies(h) for h in held))

    def clear(self) -> None:
        while self.drop_oldest():
            pass
