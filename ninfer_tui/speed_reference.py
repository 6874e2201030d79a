"""Expected decode speed per GPU and profile, for the speed check's verdict: the rows of `speed_references.json`.

Each row is of one kind: "measured" (ninfer's own run on that card), "projected" (ninfer on a card nobody here
can run, from `scripts/project_card.py`'s model: a projection, not a measurement) or "other engine" (the figures of
the native engine we compete with, from its own documentation). The verdict compares with ninfer's row for the
card (measured before projected) and shows the other engine's beside it. Rows derived from scripts/results are
written by `scripts/speed_reference_rows.py`, which names each one's source; the other rows are kept as entered.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

DATA = Path(__file__).with_name("speed_references.json")
KINDS = ("measured", "projected", "other engine")  # the order a verdict prefers them in


@dataclass(frozen=True)
class Reference:
    gpu: str  # a substring of the GPU name, or "cpu"
    profile: str
    spec: str
    decode_tok_s: float
    source: str
    setup: dict  # the settings the figure was measured (or projected) with
    kind: str = "measured"
    new_tokens: int | None = None  # tokens generated in the measured run, where it ran the speed check's task
    round_ms: float | None = None  # a round's time behind decode_tok_s, where it was timed by rounds
    tokens_per_round: float | None = None  # the tokens a round yields at the acceptance the figure assumes
    acceptance: float | None = None  # accepted / drafted, where the run reports it
    extra: dict = field(default_factory=dict)  # where the figure came from, in detail (files, runs)

    def as_dict(self) -> dict:
        return asdict(self)


def load(path: Path = DATA) -> tuple[Reference, ...]:
    return tuple(Reference(**row) for row in json.loads(path.read_text())["rows"])


REFERENCES = load()


def matching(gpu_name: str | None, profile: str, spec: str) -> list[Reference]:
    """Every row for this GPU (None: the CPU), profile and drafter, ninfer's own first (measured, then
    projected), the other engine's last."""
    key = (gpu_name or "cpu").lower()
    hits = [r for r in REFERENCES if (r.gpu == "cpu" if gpu_name is None else r.gpu.lower() in key)
            and r.profile == profile and r.spec == spec]
    return sorted(hits, key=lambda r: KINDS.index(r.kind))


def find(gpu_name: str | None, profile: str, spec: str) -> Reference | None:
    """The row a verdict compares with: ninfer's own for this card where there is one."""
    hits = matching(gpu_name, profile, spec)
    return hits[0] if hits else None


def reference_tokens(spec: str, k: int) -> float:
    """Tokens a round yields at the other engine's acceptance for this drafter and K (1 without drafts): 1 + K x
    its accepted share, the acceptance ninfer's own rows are stated at."""
    if spec == "none":
        return 1.0
    ref = next(r for r in REFERENCES if r.kind == "other engine" and r.spec == spec
               and r.setup.get("draft_tokens") == k)
    return 1 + k * ref.acceptance


def task_tokens(gpu_name: str | None, profile: str, spec: str) -> int:
    """The speed check's default length: that of the matching rows' run of the task, else that of the rows for
    this kind of device (a GPU or the CPU)."""
    for ref in matching(gpu_name, profile, spec):
        if ref.new_tokens:
            return ref.new_tokens
    return next(r.new_tokens for r in REFERENCES if r.new_tokens and (r.gpu == "cpu") == (gpu_name is None))
