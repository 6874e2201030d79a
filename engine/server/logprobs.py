"""Output tokens' logprobs in the OpenAI shapes: chat's `logprobs.content` entries (and the Responses API's, the
same entry less `top_logprobs`' bytes), and the legacy completions' parallel arrays. A token's text is its own
decoding (a byte of a character split across tokens shows as U+FFFD, as in vLLM); `bytes` are that text's."""
from __future__ import annotations

from ..runtime.request import TokenLogprob


def _token(tokenizer, token: int, logprob: float) -> dict:
    text = tokenizer.token_text(token)
    return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}


def chat_entries(tokenizer, tokens: list[int], logprobs: list[TokenLogprob]) -> list[dict]:
    """Chat's (and the Responses API's) per-token entries: the token, its logprob and bytes, and the top ones."""
    return [{**_token(tokenizer, t, lp.logprob), "top_logprobs": [_token(tokenizer, i, v) for i, v in lp.top]}
            for t, lp in zip(tokens, logprobs, strict=True)]


def completion_logprobs(tokenizer, tokens: list[int], logprobs: list[TokenLogprob], offset: int = 0) -> dict:
    """The legacy completions' `logprobs` object; `offset`: where the first token's text starts in the choice's
    text (a streamed chunk's)."""
    texts = [tokenizer.token_text(t) for t in tokens]
    starts = []
    for text in texts:
        starts.append(offset)
        offset += len(text)
    return {"tokens": texts, "token_logprobs": [lp.logprob for lp in logprobs],
            "top_logprobs": [{tokenizer.token_text(i): v for i, v in lp.top} for lp in logprobs],
            "text_offset": starts}
