"""The target as its own drafter: greedy guesses from plain decode steps on the live cache, undone before the
verify step. It drafts exactly what greedy verification picks, so it checks the round machinery (100%
acceptance) and measures a verify step's cost against plain steps; it is never faster."""
from __future__ import annotations

import torch

from ...cache.sequence import SequenceCache
from . import Drafter


class SelfDrafter(Drafter):
    reads_target_cache = True

    def __init__(self, model) -> None:
        self.model = model

    def propose(self, cache: SequenceCache, history: list[int], k: int) -> list[int]:
        length = cache.length
        saved = cache.states.snapshot() if cache.states is not None else None
        guesses, token = [], history[-1]
        for _ in range(k):
            logits = self.model.forward(torch.tensor([token], device=self.model.device), cache)
            token = int(logits[-1].argmax())
            guesses.append(token)
        # The KV these steps wrote lies past the kept length: the verify step overwrites it.
        cache.length = length
        if saved is not None:
            cache.states.restore(saved)
        return guesses
