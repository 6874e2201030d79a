"""What a caller asks for and what it gets back."""
from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from ..errors import UserError

SEED_RANGE = (-(1 << 63), (1 << 64) - 1)  # what torch.Generator.manual_seed takes
MAX_TOP_LOGPROBS = 20  # OpenAI's bound on top_logprobs
MAX_CHOICES = 16  # completions of one prompt a request may ask for (`Engine.submit_choices`)


GRAMMAR_KINDS = ("json_schema", "json_object", "regex", "lark", "gbnf")


@dataclass(frozen=True)
class Grammar:
    """A constraint on a request's output: a JSON schema (`source` its JSON text), any JSON object, a regular
    expression, or a Lark / GBNF grammar. `strict`: a JSON schema keyword the library does not implement is an
    error (else it is ignored, as OpenAI's non-strict schemas allow). `reasoning`: the output opens inside a
    `<think>` block (the prompt ends with it), so free reasoning text and `</think>` come before the constrained
    part (JSON kinds and regex)."""

    kind: str
    source: str = ""
    strict: bool = True
    reasoning: bool = False

    def __post_init__(self) -> None:
        if self.kind not in GRAMMAR_KINDS:
            raise UserError(f"grammar kind must be one of {', '.join(GRAMMAR_KINDS)}, got {self.kind!r}")
        if self.reasoning and self.kind in ("lark", "gbnf"):
            raise UserError("a Lark or GBNF grammar cannot follow reasoning", hint="write the reasoning into it")


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 256
    temperature: float = 0.7
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    # False: no drafts for this request even when the engine has a drafter (which still sees the tokens, so a
    # later request on the same conversation drafts as well as ever)
    speculate: bool = True
    grammar: Grammar | None = None  # the output follows it (masks on the picks, drafts checked against it)
    # None: no logprobs; N: each output token's logprob and the N most likely tokens' (`runtime/logprobs.py`)
    logprobs: int | None = None

    def __post_init__(self) -> None:
        for name in ("temperature", "top_p", "min_p", "repetition_penalty"):
            value = getattr(self, name)
            if not math.isfinite(value):  # NaN passes every range check below
                raise UserError(f"{name} must be a finite number, got {value}")
        if self.seed is not None and not SEED_RANGE[0] <= self.seed <= SEED_RANGE[1]:
            raise UserError(f"seed must be in [{SEED_RANGE[0]}, {SEED_RANGE[1]}], got {self.seed}")
        if self.max_tokens < 1:
            raise UserError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.temperature < 0:
            raise UserError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise UserError(f"top_p must be in (0, 1], got {self.top_p}")
        if not 0 <= self.min_p < 1:
            raise UserError(f"min_p must be in [0, 1), got {self.min_p}")
        if self.top_k < 0:
            raise UserError(f"top_k must be >= 0, got {self.top_k}")
        if self.repetition_penalty <= 0:
            raise UserError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_TOP_LOGPROBS:
            raise UserError(f"top logprobs must be in 0..{MAX_TOP_LOGPROBS}, got {self.logprobs}")

    def choice(self, i: int) -> SamplingParams:
        """The parameters of choice i of a request for several: its own seed stream, seed + i (wrapped into
        SEED_RANGE), so that with a fixed seed each choice is reproducible alone."""
        if self.seed is None or i == 0:
            return self
        lo, hi = SEED_RANGE
        return replace(self, seed=(self.seed + i - lo) % (hi - lo + 1) + lo)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1


@dataclass(frozen=True)
class Timings:
    prefill_s: float
    decode_s: float
    prefill_tokens: int
    decode_steps: int

    @property
    def prefill_tok_s(self) -> float:
        return self.prefill_tokens / self.prefill_s if self.prefill_s > 0 else 0.0

    @property
    def decode_tok_s(self) -> float:
        return self.decode_steps / self.decode_s if self.decode_s > 0 else 0.0

    def as_dict(self) -> dict:
        return {"prefill_s": self.prefill_s, "decode_s": self.decode_s,
                "prefill_tok_s": self.prefill_tok_s, "decode_tok_s": self.decode_tok_s}


@dataclass
class SpecStats:
    """Speculative decoding of one request: decode rounds (one target step each, with or without drafts),
    tokens drafted and accepted, and the time the rounds took (draft + verify + acceptance; each round ends in
    the host reading its accepted count, so its wall time is the device's)."""

    rounds: int = 0
    drafted: int = 0
    accepted: int = 0
    seconds: float = 0.0

    def add(self, drafted: int, accepted: int, seconds: float = 0.0) -> None:
        self.rounds += 1
        self.drafted += drafted
        self.accepted += accepted
        self.seconds += seconds

    @property
    def acceptance_rate(self) -> float | None:
        return self.accepted / self.drafted if self.drafted else None

    @property
    def mean_accepted(self) -> float | None:
        """Tokens each round yields: the accepted drafts plus the target's own pick."""
        return (self.accepted + self.rounds) / self.rounds if self.rounds else None

    @property
    def ms_per_round(self) -> float | None:
        return 1e3 * self.seconds / self.rounds if self.rounds else None

    def as_dict(self) -> dict:
        return {"rounds": self.rounds, "drafted": self.drafted, "accepted": self.accepted,
                "acceptance_rate": self.acceptance_rate, "mean_accepted": self.mean_accepted,
                "ms_per_round": self.ms_per_round}


@dataclass(frozen=True)
class TokenLogprob:
    """An output token's log-probability and the most likely tokens' at its place, (id, logprob) largest first."""

    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True)
class TokenEvent:
    """One generated token and the text it makes visible (may be empty while a stop string or UTF-8
    sequence is pending). `token_id` is None for the held-back text released at the end. `logprob`: when the
    request asked for logprobs."""

    token_id: int | None
    text: str
    logprob: TokenLogprob | None = None


@dataclass(frozen=True)
class FinishEvent:
    finish_reason: str  # "stop" | "length" | "cancelled"
    prompt_tokens: int
    completion_tokens: int
    token_ids: list[int] = field(repr=False)
    text: str
    timings: Timings
    cached_tokens: int = 0  # prompt tokens served from a held sequence instead of prefilled
    stop_string: str | None = None  # the stop string that ended the text, if one did
    spec: SpecStats | None = None  # with speculative decoding
    stop_token_id: int | None = None  # the stop token that ended the output (not in token_ids)
    logprobs: list[TokenLogprob] | None = field(default=None, repr=False)  # token_ids' own, when asked for
