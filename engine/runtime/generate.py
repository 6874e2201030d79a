"""The generation loop for one sequence: chunked prefill, then rounds of one step each. A round feeds the
pending token plus the drafter's guesses (none without speculative decoding), keeps the guesses the target
agrees with, and yields them one by one before the next round."""
from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Protocol

import torch

from ..cache.sequence import SequenceCache
from ..models.capture import Capture
from ..models.spec import ModelSpec
from ..tokenizer import Tokenizer
from ..transfer import token_ids
from .request import FinishEvent, SamplingParams, SpecStats, Timings, TokenEvent
from .sampler import Sampler
from .spec import Drafter
from .stops import StopMatcher


class CausalModel(Protocol):
    device: torch.device
    spec: ModelSpec

    def new_cache(self, max_len: int) -> SequenceCache: ...

    def forward(self, ids: torch.Tensor, cache: SequenceCache, all_logits: bool = False,
                capture: Capture | None = None, keep_steps: bool = False,
                positions: torch.Tensor | None = None) -> torch.Tensor: ...


@dataclass
class _Step:
    """One target step: the tokens fed and what the drafter may need of them."""

    ids: list[int]
    capture: Capture | None


def _run(model: CausalModel, piece: torch.Tensor, cache: SequenceCache, drafter: Drafter | None,
         all_logits: bool = False, keep_steps: bool = False) -> tuple[torch.Tensor, Capture | None]:
    capture = drafter.capture() if drafter is not None else None
    logits = model.forward(piece, cache, all_logits=all_logits, capture=capture, keep_steps=keep_steps)
    return logits, capture


def prefill(model: CausalModel, ids: list[int], cache: SequenceCache, chunk: int,
            drafter: Drafter | None = None, following: int | None = None) -> tuple[torch.Tensor, _Step]:
    """Feed `ids` in chunks; returns the logits of the last token and the last chunk's step. Every chunk
    but the last is shown to the drafter at once; the last one too when the token `following` it is known."""
    logits, step = None, None
    for i in range(0, len(ids), chunk):
        logits, capture = _run(model, token_ids(ids[i:i + chunk], model.device), cache, drafter)
        step = _Step(ids[i:i + chunk], capture)
        nxt = ids[i + chunk] if i + chunk < len(ids) else following
        if drafter is not None and nxt is not None:
            drafter.observe(cache, step.ids, step.capture, nxt)
    return logits[-1], step


def generate(model: CausalModel, tokenizer: Tokenizer, prompt_ids: list[int], params: SamplingParams,
             cache: SequenceCache, prefill_chunk: int, cancel: threading.Event | None = None,
             checkpoints: tuple[int, ...] = (), on_checkpoint: Callable[[int], None] | None = None,
             drafter: Drafter | None = None, draft_tokens: int = 0) -> Iterator[TokenEvent | FinishEvent]:
    """Stream TokenEvents, then one FinishEvent. Closing the iterator, or setting `cancel`, stops the generation.

    The first `cache.length` prompt tokens are already in the cache (a reused prefix) and are not run again.
    `cache.length` always counts tokens of prompt + output only, so a caller can keep the cache for the next
    turn. The prefill stops at each of `checkpoints` (prompt positions) and at the prompt's end to call
    `on_checkpoint`. With a drafter, each round verifies up to `draft_tokens` guesses in one step.
    """
    cached = cache.length
    sampler = Sampler(params, model.spec.vocab_size, model.device, prompt_ids)
    stop_ids = set(params.stop_token_ids) | (set() if params.ignore_eos else set(tokenizer.eos_ids))
    matcher = StopMatcher(params.stop)
    detok = tokenizer.stream()
    out_ids: list[int] = []
    history = list(prompt_ids)  # prompt + output, grown as tokens are yielded (drafters read it)
    text_parts: list[str] = []
    budget = min(params.max_tokens, cache.capacity - len(prompt_ids))
    stats = SpecStats()

    with torch.inference_mode():
        t0 = time.perf_counter()
        if drafter is not None:
            drafter.prepare(cache)
        stops = sorted({p for p in checkpoints if cached <= p < len(prompt_ids)} | {len(prompt_ids)})
        for stop in stops:
            if stop > cache.length:
                following = prompt_ids[stop] if stop < len(prompt_ids) else None
                logits, step = prefill(model, prompt_ids[cache.length:stop], cache, prefill_chunk, drafter,
                                       following)
            if on_checkpoint is not None:
                on_checkpoint(stop)
        token = sampler(logits)
        if drafter is not None:
            drafter.observe(cache, step.ids, step.capture, token)
        t1 = time.perf_counter()

        # The open round: its step, and how many of its fed tokens the output has reached so far.
        open_step: _Step | None = None
        kept = 0
        queue: list[int] = []  # accepted drafts not yet yielded; the round's last token follows them

        def settle(next_token: int) -> None:
            """Close the open round: the cache keeps the fed tokens the output reached."""
            nonlocal open_step
            cache.commit(len(open_step.ids), kept)
            if drafter is not None:
                drafter.observe(cache, open_step.ids[:kept],
                                open_step.capture.first(kept) if open_step.capture else None, next_token)
            open_step = None

        finish = "length"
        while True:
            if open_step is not None and not queue:
                settle(token)  # `token` is the round's own pick, which was not fed
            if cancel is not None and cancel.is_set():
                finish = "cancelled"
                break
            if token in stop_ids:
                finish = "stop"
                break
            out_ids.append(token)
            history.append(token)
            if open_step is not None:
                kept += 1
            visible = matcher.feed(detok.push(token))
            text_parts.append(visible)
            yield TokenEvent(token, visible)
            if matcher.stopped or len(out_ids) >= budget:
                finish = "stop" if matcher.stopped else "length"
                if open_step is not None:
                    settle(queue[0])  # `token` was yielded: the cache may keep it
                break
            if queue:
                token = queue.pop(0)
                continue
            round_start = time.perf_counter()
            k = 0
            if drafter is not None and params.speculate:
                k = max(0, min(draft_tokens, budget - len(out_ids) - 1, cache.capacity - cache.length - 1))
            drafts = drafter.propose(cache, history, k)[:k] if k else []
            if isinstance(drafts, torch.Tensor):  # guesses made on the device stay there: no sync before verify
                fed = torch.cat([token_ids([token], model.device), drafts])
            else:
                fed = token_ids([token] + drafts, model.device)
            logits, capture = _run(model, fed, cache, drafter, all_logits=len(drafts) > 0,
                                   keep_steps=len(drafts) > 0)
            accepted, next_token, drafts = sampler.accept(logits, drafts)  # the round's one host sync
            open_step = _Step([token] + drafts, capture)
            token = next_token
            kept = 1
            queue = drafts[:accepted]
            stats.add(len(drafts), accepted, time.perf_counter() - round_start)
            if queue:
                token, queue = queue[0], queue[1:] + [token]
        if open_step is not None:
            settle(token)
        t2 = time.perf_counter()
    tail = matcher.flush() if not matcher.stopped else ""
    if tail:
        text_parts.append(tail)
        yield TokenEvent(None, tail)
    yield FinishEvent(finish, len(prompt_ids), len(out_ids), out_ids, "".join(text_parts),
                      Timings(t1 - t0, t2 - t1, len(prompt_ids) - cached, max(0, len(out_ids) - 1)),
                      cached_tokens=cached, stop_string=matcher.matched,
                      spec=stats if drafter is not None else None)
