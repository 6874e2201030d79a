"""How many drafts each speculative round verifies: up to `draft_tokens`, fewer for a request whose drafts are
seldom accepted, and none in a step where drafting does not pay at the current load.

Per request, a draft is worth its row while the chance that it and every draft before it are accepted stays at
least MIN_REACH: with a per-draft acceptance q (a decayed count of accepted and rejected drafts), the j-th draft
goes in while q**j >= MIN_REACH. Per load, the core measures what each step made: output tokens per second of the
steps that drafted and of those that did not, for each count of running requests, and a step drafts when its
drafting figure is the better one (or still unknown). Every EXPLORE steps the other choice runs once, so neither
figure goes stale as prompts, acceptance and the load change. The choice only moves K: the output is the same
(speculative decoding is lossless)."""
from __future__ import annotations

from dataclasses import dataclass, field

MIN_REACH = 0.1  # the least chance, for a draft's row, that the target reaches and accepts it
DECAY = 0.8  # weight of a request's earlier rounds in its acceptance count, per round
EXPLORE = 32  # a step tries the choice it would not make once in this many steps
SMOOTH = 0.2  # weight of a step in the tokens-per-second figures


@dataclass
class Acceptance:
    """A request's recent drafts: accepted and rejected, decayed per round (a Beta(1 + hits, 1 + misses) mean)."""

    hits: float = 0.0
    misses: float = 0.0

    def add(self, drafted: int, accepted: int) -> None:
        self.hits = DECAY * self.hits + accepted
        self.misses = DECAY * self.misses + (1 if accepted < drafted else 0)

    @property
    def rate(self) -> float:
        return (1.0 + self.hits) / (2.0 + self.hits + self.misses)

    def drafts(self, most: int) -> int:
        """Drafts worth verifying: the j-th while rate**j >= MIN_REACH."""
        k, reach = 0, self.rate
        while k < most and reach >= MIN_REACH:
            k += 1
            reach *= self.rate
        return k


@dataclass
class LoadChoice:
    """Whether this step drafts, from the tokens per second that drafting and plain steps made at this load."""

    rates: dict[tuple[int, bool], float] = field(default_factory=dict)  # (running, drafted) -> tokens / s
    steps: int = 0

    def drafting(self, running: int) -> bool:
        self.steps += 1
        with_drafts, plain = self.rates.get((running, True)), self.rates.get((running, False))
        if with_drafts is None:
            return True
        if plain is None:
            return self.steps % EXPLORE != 0
        better = with_drafts >= plain
        return better != (self.steps % EXPLORE == 0)

    def record(self, running: int, drafted: bool, tokens: int, seconds: float) -> None:
        if seconds <= 0:
            return
        rate = tokens / seconds
        key = (running, drafted)
        old = self.rates.get(key)
        self.rates[key] = rate if old is None else (1 - SMOOTH) * old + SMOOTH * rate
