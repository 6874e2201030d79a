"""Prompt-lookup drafting: no weights; the tokens that followed the last earlier occurrence of the context's
final n-gram are the guess. Strong wherever output repeats its input (code edits, agent loops, quoting)."""
from __future__ import annotations

from ...cache.sequence import SequenceCache
from . import Drafter


def lookup(history: list[int], k: int, max_n: int = 4, min_n: int = 1) -> list[int]:
    """The k tokens after the most recent earlier match of the longest suffix n-gram (max_n down to min_n), by
    scanning the history: the reference `NgramIndex` is tested against."""
    size = len(history)
    for n in range(min(max_n, size - 1), min_n - 1, -1):
        suffix = history[size - n:]
        for start in range(size - n - 1, -1, -1):  # newest match first; it must end before the suffix itself
            if history[start:start + n] == suffix:
                follow = history[start + n:start + n + k]
                if follow:
                    return follow
    return []


class NgramIndex:
    """`lookup` without the scan: where each n-gram of a sequence's tokens (n = min_n..max_n) last started among
    those followed by at least one token, extended by the tokens added since the last round. A scan costs 10 ms
    per round at 32K tokens of context and 51 ms at 128K in Python, against a 6-11 ms round on the GPU (agent
    loops, ngram's use, carry long contexts); the index costs ~0.01-0.02 ms per round, a one-time build of ~7 ms
    per 4K prompt tokens, and ~130 bytes of host memory per token and n (68 MB at 128K; scripts/bench_ngram.py).
    It lives with the sequence (`cache.draft`), so a held conversation keeps it."""

    def __init__(self, max_n: int = 4, min_n: int = 1) -> None:
        self.max_n, self.min_n = max_n, min_n
        self.source: list[int] = []  # the history indexed (the generation loop appends to it in place)
        self.known = 0  # how many of its tokens are indexed
        self.starts: dict[tuple[int, ...], int] = {}

    def _sync(self, history: list[int]) -> None:
        known = self.known
        if len(history) < known or (history is not self.source and history[:known] != self.source[:known]):
            self.starts, known = {}, 0  # another sequence, or an edited one
        self.source = history
        # an n-gram enters once a token follows it: those ending before the history's last token
        for end in range(max(known, 1), len(history)):
            for n in range(self.min_n, min(self.max_n, end) + 1):
                self.starts[tuple(history[end - n:end])] = end - n
        self.known = len(history)

    def lookup(self, history: list[int], k: int) -> list[int]:
        self._sync(history)
        size = len(history)
        for n in range(min(self.max_n, size - 1), self.min_n - 1, -1):
            start = self.starts.get(tuple(history[size - n:]))
            if start is not None:
                return history[start + n:start + n + k]
        return []


class NgramDrafter(Drafter):
    def __init__(self, max_n: int = 4, min_n: int = 1) -> None:
        self.max_n, self.min_n = max_n, min_n

    def propose(self, cache: SequenceCache, history: list[int], k: int) -> list[int]:
        if not isinstance(cache.draft, NgramIndex):
            cache.draft = NgramIndex(self.max_n, self.min_n)
        return cache.draft.lookup(history, k)
