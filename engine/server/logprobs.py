"""Output tokens' logprobs in the OpenAI shapes: chat's `logprobs.content` entries (and the Responses API's, the
same entry less `top_logprobs`' bytes), and the legacy completions' parallel arrays.

A token's `bytes` are its own (`token_bytes`), so a character split across tokens is whole again when their bytes
are joined. Its text is those bytes decoded, as OpenAI writes it where they are part of a character: each such
byte as a `\\xNN` escape in chat (its cookbook's `\\xf0\\x9f\\x92` for the first three bytes of an emoji), and the
legacy completions' whole token prefixed with `bytes:`. `text_offset` counts the characters of the decoded text
that end before a token: a token that ends a character begun by the tokens before it starts at that character."""
from __future__ import annotations

import codecs

from ..runtime.request import TokenLogprob


def _text(raw: bytes) -> str:
    return raw.decode("utf-8", "backslashreplace")


def _legacy_text(raw: bytes) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return "bytes:" + _text(raw)


def _token(tokenizer, token: int, logprob: float) -> dict:
    raw = tokenizer.token_bytes(token)
    return {"token": _text(raw), "logprob": logprob, "bytes": list(raw)}


def chat_entries(tokenizer, tokens: list[int], logprobs: list[TokenLogprob]) -> list[dict]:
    """Chat's (and the Responses API's) per-token entries: the token, its logprob and bytes, and the top ones."""
    return [{**_token(tokenizer, t, lp.logprob), "top_logprobs": [_token(tokenizer, i, v) for i, v in lp.top]}
            for t, lp in zip(tokens, logprobs, strict=True)]


class TextOffsets:
    """Where each of a choice's tokens starts in its text, in characters, token after token (a stream's chunks
    share one): the characters that end before its first byte. Bytes that never make a character are one U+FFFD
    in the text, as the decoder replaces them, which it knows only at the byte after them."""

    def __init__(self) -> None:
        self._decoder = codecs.getincrementaldecoder("utf-8")("replace")
        self._chars = 0

    def start(self, raw: bytes) -> int:
        """The next token's offset, given its bytes."""
        if not raw:
            return self._chars
        first = self._decoder.decode(raw[:1])
        waits = bool(self._decoder.getstate()[0])  # the first byte begins or continues a character
        at = self._chars + len(first) - (0 if waits else 1)  # else the last character decoded holds it
        self._chars += len(first) + len(self._decoder.decode(raw[1:]))
        return at


def completion_logprobs(tokenizer, tokens: list[int], logprobs: list[TokenLogprob],
                        offsets: TextOffsets | None = None) -> dict:
    """The legacy completions' `logprobs` object; `offsets`: the choice's so far (a stream's earlier chunks)."""
    offsets = offsets if offsets is not None else TextOffsets()
    raws = [tokenizer.token_bytes(t) for t in tokens]
    return {"tokens": [_legacy_text(r) for r in raws], "token_logprobs": [lp.logprob for lp in logprobs],
            "top_logprobs": [{_legacy_text(tokenizer.token_bytes(i)): v for i, v in lp.top} for lp in logprobs],
            "text_offset": [offsets.start(r) for r in raws]}
