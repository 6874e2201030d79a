"""The generation loop for one sequence: chunked prefill, then one token per step."""
from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from typing import Protocol

import torch

from ..cache.sequence import SequenceCache
from ..models.spec import ModelSpec
from ..tokenizer import Tokenizer
from .request import FinishEvent, SamplingParams, Timings, TokenEvent
from .sampler import Sampler
from .stops import StopMatcher


class CausalModel(Protocol):
    device: torch.device
    spec: ModelSpec

    def new_cache(self, max_len: int) -> SequenceCache: ...

    def forward(self, ids: torch.Tensor, cache: SequenceCache, all_logits: bool = False) -> torch.Tensor: ...


def prefill(model: CausalModel, ids: list[int], cache: SequenceCache, chunk: int) -> torch.Tensor:
    """Feed `ids` in chunks; returns the logits of the last token."""
    logits = None
    for i in range(0, len(ids), chunk):
        piece = torch.tensor(ids[i : i + chunk], dtype=torch.long, device=model.device)
        logits = model.forward(piece, cache)
    return logits[-1]


def generate(model: CausalModel, tokenizer: Tokenizer, prompt_ids: list[int], params: SamplingParams,
             cache: SequenceCache, prefill_chunk: int, cancel: threading.Event | None = None,
             checkpoints: tuple[int, ...] = (), on_checkpoint: Callable[[int], None] | None = None) -> \
        Iterator[TokenEvent | FinishEvent]:
    """Stream TokenEvents, then one FinishEvent. Closing the iterator, or setting `cancel`, stops the generation.

    The first `cache.length` prompt tokens are already in the cache (a reused prefix) and are not run again.
    `cache.length` always equals the tokens actually run, so a caller can keep the cache for the next turn.
    The prefill stops at each of `checkpoints` (prompt positions) and at the prompt's end to call `on_checkpoint`.
    """
    cached = cache.length
    sampler = Sampler(params, model.spec.vocab_size, model.device, prompt_ids)
    stop_ids = set(params.stop_token_ids) | (set() if params.ignore_eos else set(tokenizer.eos_ids))
    matcher = StopMatcher(params.stop)
    detok = tokenizer.stream()
    out_ids: list[int] = []
    text_parts: list[str] = []
    budget = min(params.max_tokens, cache.capacity - len(prompt_ids))

    with torch.inference_mode():
        t0 = time.perf_counter()
        stops = sorted({p for p in checkpoints if cached <= p < len(prompt_ids)} | {len(prompt_ids)})
        for stop in stops:
            if stop > cache.length:
                logits = prefill(model, prompt_ids[cache.length:stop], cache, prefill_chunk)
            if on_checkpoint is not None:
                on_checkpoint(stop)
        token = sampler(logits)
        t1 = time.perf_counter()
        finish, steps = "length", 0
        while True:
            if cancel is not None and cancel.is_set():
                finish = "cancelled"
                break
            if token in stop_ids:
                finish = "stop"
                break
            out_ids.append(token)
            visible = matcher.feed(detok.push(token))
            text_parts.append(visible)
            yield TokenEvent(token, visible)
            if matcher.stopped:
                finish = "stop"
                break
            if len(out_ids) >= budget:
                break
            logits = model.forward(torch.tensor([token], dtype=torch.long, device=model.device), cache)
            token = sampler(logits[-1])
            steps += 1
        t2 = time.perf_counter()
    tail = matcher.flush() if not matcher.stopped else ""
    if tail:
        text_parts.append(tail)
        yield TokenEvent(None, tail)
    yield FinishEvent(finish, len(prompt_ids), len(out_ids), out_ids, "".join(text_parts),
                      Timings(t1 - t0, t2 - t1, len(prompt_ids) - cached, steps), cached_tokens=cached,
                      stop_string=matcher.matched)

