"""Held sequences: finished conversations whose KV cache and recurrent state stay on the device, so the next turn
(which resends the whole conversation) prefills only its new tokens."""
from __future__ import annotations

from collections import OrderedDict
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


class HeldSequences:
    """An LRU of held sequences; taking one removes it (a running sequence is never shared)."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._items: OrderedDict[int, HeldSequence] = OrderedDict()
        self._next = 0

    def __len__(self) -> int:
        return len(self._items)

    @property
    def tokens(self) -> int:
        return sum(h.cache.length for h in self._items.values())

    def take_best(self, prompt: list[int]) -> tuple[HeldSequence | None, int]:
        best, best_n = None, 0
        for key, held in self._items.items():
            n = reusable_tokens(held, prompt)
            if n > best_n:
                best, best_n = key, n
        if best is None:
            return None, 0
        return self._items.pop(best), best_n

    def put(self, held: HeldSequence) -> None:
        if self.capacity <= 0:
            return
        self._items[self._next] = held
        self._next += 1
        while len(self._items) > self.capacity:
            self._items.popitem(last=False)

    def clear(self) -> None:
        self._items.clear()
