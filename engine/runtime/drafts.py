"""How many drafts each speculative round verifies: up to `draft_tokens`, fewer for a request whose drafts are
seldom accepted, and none in a step where drafting does not pay at the current load.

Per request, a draft is worth its row while the chance that it and every draft before it are accepted stays at
least MIN_REACH: with a per-draft acceptance q (a decayed count of accepted and rejected drafts), the j-th draft
goes in while q**j >= MIN_REACH. Per load, the core times steps that drafted and steps that did not, for each
count of running requests, and a step drafts when the tokens its requests' acceptance promises per drafting
step's time beat one token each per plain step's time (a first drafting step, then a first plain one, measure
both at each load). Times depend on
acceptance far less than tokens per second do (a batch verify graph pads every request to K+1; a lane's own graph
pads to the next captured size), so a figure measured while drafts failed (a new conversation, a drafter warming
up) does not hold drafting back once the requests' acceptance says it pays. Every EXPLORE steps
the other choice runs once, so neither time goes stale and a request's acceptance keeps being measured. The
choice only moves K: the output is the same (speculative decoding is lossless)."""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from statistics import median

MIN_REACH = 0.1  # the least chance, for a draft's row, that the target reaches and accepts it
DECAY = 0.8  # weight of a request's earlier rounds in its acceptance count, per round
EXPLORE = 32  # a step tries the choice it would not make once in this many steps
RECENT = 9  # steps whose median is a step-time figure: one stalled step (a busy machine) moves it nowhere


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
    """Whether this step drafts, from the measured step times of drafting and plain steps at this load and the
    tokens the running requests' acceptance promises."""

    recent: dict[tuple[int, bool], deque[float]] = field(default_factory=dict)  # (running, drafted) -> seconds
    counts: dict[tuple[int, bool], int] = field(default_factory=dict)  # (running, drafted) -> steps recorded
    steps: int = 0

    def time(self, running: int, drafted: bool) -> float | None:
        """A step's time at `running` requests, drafting or not: the median of the recent ones (None: none yet)."""
        recent = self.recent.get((running, drafted))
        return median(recent) if recent else None

    def drafting(self, running: int, promised: float) -> bool:
        """`promised`: the tokens a drafting step is expected to output for the `running` requests (each one's
        token and its expected accepted drafts)."""
        self.steps += 1
        with_drafts, plain = self.time(running, True), self.time(running, False)
        if with_drafts is None:
            return True
        if plain is None:  # the plain time is measured as soon as a drafting one is: the choice needs both
            return False
        better = promised / with_drafts >= running / plain
        return better != (self.steps % EXPLORE == 0)

    def record(self, running: int, drafted: bool, seconds: float) -> None:
        if seconds > 0:
            self.recent.setdefault((running, drafted), deque(maxlen=RECENT)).append(seconds)
            self.counts[running, drafted] = self.counts.get((running, drafted), 0) + 1

    def summary(self) -> dict[str, dict[str, float | int | None]]:
        """Per count of running requests: the step times the choice compares (ms) and the steps of each kind,
        for /health and the benchmarks (what the choice saw, where drafting does not pay as it should). Another
        thread may ask while the loop records: it reads copies (each made in one C call under the GIL)."""
        counts = dict(self.counts)
        recent = {key: list(times) for key, times in dict(self.recent).items()}
        out = {}
        for running in sorted({r for r, _ in counts}):
            ms = {kind: round(median(recent[running, drafted]) * 1e3, 3) if recent.get((running, drafted)) else None
                  for kind, drafted in (("drafting", True), ("plain", False))}
            out[str(running)] = {"drafting_ms": ms["drafting"], "plain_ms": ms["plain"],
                                 "drafting_steps": counts.get((running, True), 0),
                                 "plain_steps": counts.get((running, False), 0)}
        return out


def promised_tokens(acceptance: Acceptance, most: int) -> float:
    """The tokens a round of `acceptance.drafts(most)` drafts is expected to output: its own pick and each draft
    that it and every one before it are accepted (rate**j for the j-th)."""
    q = acceptance.rate
    return 1.0 + sum(q ** j for j in range(1, acceptance.drafts(most) + 1))
