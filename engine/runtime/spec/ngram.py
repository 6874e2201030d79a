"""Prompt-lookup drafting: no weights; the tokens that followed the last earlier occurrence of the context's
final n-gram are the guess. Strong wherever output repeats its input (code edits, agent loops, quoting)."""
from __future__ import annotations

from ...cache.sequence import SequenceCache
from . import Drafter


def lookup(history: list[int], k: int, max_n: int = 4, min_n: int = 1) -> list[int]:
    """The k tokens after the most recent earlier match of the longest suffix n-gram (max_n down to min_n)."""
    size = len(history)
    for n in range(min(max_n, size - 1), min_n - 1, -1):
        suffix = history[size - n:]
        for start in range(size - n - 1, -1, -1):  # newest match first; it must end before the suffix itself
            if history[start:start + n] == suffix:
                follow = history[start + n:start + n + k]
                if follow:
                    return follow
    return []


class NgramDrafter(Drafter):
    def __init__(self, max_n: int = 4, min_n: int = 1) -> None:
        self.max_n, self.min_n = max_n, min_n

    def propose(self, cache: SequenceCache, history: list[int], k: int) -> list[int]:
        return lookup(history, k, self.max_n, self.min_n)
