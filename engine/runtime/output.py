"""What a request's caller sees of its picked tokens: the stop tokens and strings, the token budget, the text."""
from __future__ import annotations

from ..tokenizer import Tokenizer
from .request import SamplingParams, TokenEvent, TokenLogprob
from .stops import StopMatcher


class Output:
    def __init__(self, tokenizer: Tokenizer, params: SamplingParams, history: list[int], budget: int) -> None:
        self.stop_ids = set(params.stop_token_ids) | (set() if params.ignore_eos else set(tokenizer.eos_ids))
        self.matcher = StopMatcher(params.stop)
        self.detok = tokenizer.stream()
        self.ids: list[int] = []
        self.history = history  # prompt + output, grown as tokens are output (drafters read it)
        self.text_parts: list[str] = []
        self.budget = budget
        self.stop_token: int | None = None  # the stop token that ended the output (not part of it)
        self.logprobs: list[TokenLogprob] | None = [] if params.logprobs is not None else None  # ids' own

    def refuses(self, token: int) -> bool:
        """Whether the output ends before `token` (a stop token)."""
        if token in self.stop_ids:
            self.stop_token = token
            return True
        return False

    def push(self, token: int, logprob: TokenLogprob | None = None) -> TokenEvent:
        self.ids.append(token)
        self.history.append(token)
        if self.logprobs is not None and logprob is not None:
            self.logprobs.append(logprob)
        visible = self.matcher.feed(self.detok.push(token))
        self.text_parts.append(visible)
        return TokenEvent(token, visible, logprob)

    @property
    def full(self) -> str | None:
        """The finish reason when the output may not grow past its last token."""
        if self.matcher.stopped:
            return "stop"
        return "length" if len(self.ids) >= self.budget else None

    def tail(self) -> TokenEvent | None:
        """The text a pending stop-string match held back, released at the end (none after a stop string)."""
        text = self.matcher.flush() if not self.matcher.stopped else ""
        if not text:
            return None
        self.text_parts.append(text)
        return TokenEvent(None, text)
