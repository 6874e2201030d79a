"""The per-sequence generation loop the engine core replaced (kept for the same-run A/B of `ab_loop.py`).

The generation loop for one sequence: chunked prefill, then decode. Without a drafter, one token per step,
each step launched before the host reads the token it feeds (`_decode`). With one, rounds of one step each: a
round feeds the pending token plus the drafter's guesses, keeps the guesses the target agrees with, and yields
them one by one before the next round (`_speculate`)."""
from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Protocol

import torch

from engine.cache.kv_pool import KVPool
from engine.cache.sequence import SequenceCache
from engine.models.spec import ModelSpec
from engine.models.taps import Taps
from engine.runtime.drafting import Drafter
from engine.runtime.request import FinishEvent, SamplingParams, SpecStats, Timings, TokenEvent
from engine.runtime.sampler import Sampler
from engine.runtime.stops import StopMatcher
from engine.tokenizer import Tokenizer
from engine.transfer import HostCopy, to_device

# Where a decode step is launched before the host reads the token it feeds: devices whose launches return at once.
# (Elsewhere the launch would run the step, so the token would reach the client one step late.)
AHEAD_DEVICES = frozenset({"cuda"})


class CausalModel(Protocol):
    device: torch.device
    geometry: ModelSpec

    def new_cache(self, max_len: int, pool: KVPool | None = None) -> SequenceCache: ...

    def prefill_piece(self, tokens: int) -> int: ...

    def forward(self, ids: torch.Tensor, cache: SequenceCache, all_logits: bool = False,
                taps: Taps | None = None, keep_inputs: bool = False,
                positions: torch.Tensor | None = None) -> torch.Tensor: ...


@dataclass
class _Step:
    """One target step: the tokens fed and what the drafter may need of them."""

    ids: list[int]
    taps: Taps | None


def _run(model: CausalModel, piece: torch.Tensor, cache: SequenceCache, drafter: Drafter | None,
         all_logits: bool = False, keep_inputs: bool = False) -> tuple[torch.Tensor, Taps | None]:
    taps = drafter.taps() if drafter is not None else None
    cache.ensure(cache.length + piece.shape[0])
    logits = model.forward(piece, cache, all_logits=all_logits, taps=taps, keep_inputs=keep_inputs)
    return logits, taps


def _steps(model: CausalModel, n: int, chunk: int) -> Iterator[tuple[int, int, bool]]:
    """(start, stop, kept) of the steps that feed n tokens: chunks of `chunk` tokens, each in one eager step or,
    where the model runs a chunk that short as graphed pieces (`prefill_piece`), in pieces that keep their GDN
    inputs until their commit."""
    for i in range(0, n, chunk):
        stop = min(n, i + chunk)
        piece = model.prefill_piece(stop - i)
        for j in range(i, stop, piece or chunk):
            yield j, min(stop, j + (piece or chunk)), piece > 0


def prefill(model: CausalModel, ids: list[int], cache: SequenceCache, chunk: int,
            drafter: Drafter | None = None, following: int | None = None) -> tuple[torch.Tensor, _Step]:
    """Feed `ids` in steps (`_steps`); returns the logits of the last token and the last step. Every step but
    the last is shown to the drafter at once; the last one too when the token `following` it is known."""
    logits, step = None, None
    for start, stop, kept in _steps(model, len(ids), chunk):
        logits, taps = _run(model, to_device(ids[start:stop], model.device), cache, drafter, keep_inputs=kept)
        if kept:
            cache.commit(stop - start, stop - start)
        step = _Step(ids[start:stop], taps)
        nxt = ids[stop] if stop < len(ids) else following
        if drafter is not None and nxt is not None:
            drafter.observe(cache, step.ids, step.taps, nxt)
    return logits[-1], step


class _Output:
    """What the caller sees of the picked tokens: the stop tokens and strings, the token budget, the text."""

    def __init__(self, tokenizer: Tokenizer, params: SamplingParams, history: list[int], budget: int) -> None:
        self.stop_ids = set(params.stop_token_ids) | (set() if params.ignore_eos else set(tokenizer.eos_ids))
        self.matcher = StopMatcher(params.stop)
        self.detok = tokenizer.stream()
        self.ids: list[int] = []
        self.history = history  # prompt + output, grown as tokens are yielded (drafters read it)
        self.text_parts: list[str] = []
        self.budget = budget
        self.stop_token: int | None = None  # the stop token that ended the output (not part of it)

    def refuses(self, token: int, cancel: threading.Event | None) -> str | None:
        """The finish reason when the generation ends before `token` is output."""
        if cancel is not None and cancel.is_set():
            return "cancelled"
        if token in self.stop_ids:
            self.stop_token = token
            return "stop"
        return None

    def push(self, token: int) -> TokenEvent:
        self.ids.append(token)
        self.history.append(token)
        visible = self.matcher.feed(self.detok.push(token))
        self.text_parts.append(visible)
        return TokenEvent(token, visible)

    @property
    def full(self) -> str | None:
        """The finish reason when the output may not grow past its last token."""
        if self.matcher.stopped:
            return "stop"
        return "length" if len(self.ids) >= self.budget else None


def _decode(model: CausalModel, sampler: Sampler, cache: SequenceCache, out: _Output, first: torch.Tensor,
            cancel: threading.Event | None, started: Callable[[], None]) -> Iterator[TokenEvent]:
    """Plain decode, one token per step, from `first` (the prefill's pick, on the device); returns the finish
    reason. A pick stays on the device and feeds the next step there. On a GPU that step is launched before the
    host reads the pick, so the device always has the next step queued while the host yields this token
    (detokenizes, matches stop strings, hands it to the client); the one step too many that this launches when
    the token ends the output feeds the token that ended it (a stop token, kept in the cache: a chat's next turn
    starts with it) or its last token."""
    ahead = model.device.type in AHEAD_DEVICES

    def step(token: torch.Tensor) -> tuple[torch.Tensor, HostCopy]:
        cache.ensure(cache.length + 1)
        picked = sampler.pick(model.forward(token.view(1), cache)[-1])
        return picked, HostCopy(picked)

    token_d, host = first, HostCopy(first)
    while True:
        following = step(token_d) if ahead and len(out.ids) + 1 < out.budget else None
        token = int(host.result())
        started()
        finish = out.refuses(token, cancel)
        if finish is not None:
            return finish
        yield out.push(token)
        if out.full is not None:
            return out.full
        token_d, host = following if following is not None else step(token_d)


def _speculate(model: CausalModel, sampler: Sampler, cache: SequenceCache, out: _Output, token: int,
               step: _Step, drafter: Drafter, draft_tokens: int, params: SamplingParams,
               cancel: threading.Event | None, stats: SpecStats) -> Iterator[TokenEvent]:
    """Decode in rounds of one verify step each (the pending token plus the drafter's guesses); returns the
    finish reason. A round ends in the host reading how many guesses the target kept."""
    drafter.observe(cache, step.ids, step.taps, token)
    # The open round: its step, and how many of its fed tokens the output has reached so far.
    open_step: _Step | None = None
    kept = 0
    queue: list[int] = []  # accepted drafts not yet yielded; the round's last token follows them
    # A closed round's (fed, kept) whose cache commit waits for the next verify step: the drafter observes and
    # proposes first (it reads only its own state), so the rollback is launched while the device drafts instead
    # of the device waiting for the host to launch it.
    uncommitted: tuple[int, int] | None = None
    reads_target = getattr(drafter, "reads_target_cache", Drafter.reads_target_cache)

    def commit() -> None:
        nonlocal uncommitted
        if uncommitted is not None:
            cache.commit(*uncommitted)
            uncommitted = None

    def settle(next_token: int) -> None:
        """Close the open round: the drafter sees the fed tokens the output reached; the cache keeps them at the
        next `commit`."""
        nonlocal open_step, uncommitted
        uncommitted = (len(open_step.ids), kept)
        drafter.observe(cache, open_step.ids[:kept], open_step.taps.first(kept) if open_step.taps else None,
                        next_token)
        open_step = None

    while True:
        if open_step is not None and not queue:
            settle(token)  # `token` is the round's own pick, which was not fed
        finish = out.refuses(token, cancel)
        if finish is not None:
            if open_step is not None:
                settle(token)  # `token` (an accepted draft) was not yielded: the cache keeps what was
            commit()
            return finish
        if open_step is not None:
            kept += 1
        yield out.push(token)
        if out.full is not None:
            if open_step is not None:
                settle(queue[0])  # `token` was yielded: the cache may keep it
            commit()
            return out.full
        if queue:
            token = queue.pop(0)
            continue
        round_start = time.perf_counter()
        if reads_target:
            commit()
        k = 0
        if params.speculate:
            length = cache.length - (uncommitted[0] - uncommitted[1] if uncommitted is not None else 0)
            k = max(0, min(draft_tokens, out.budget - len(out.ids) - 1, cache.capacity - length - 1))
        drafts = drafter.propose(cache, out.history, k)[:k] if k else []
        commit()
        if isinstance(drafts, torch.Tensor):  # guesses made on the device stay there: no sync before verify
            fed = torch.cat([to_device([token], model.device), drafts])
        else:
            fed = to_device([token] + drafts, model.device)
        logits, taps = _run(model, fed, cache, drafter, all_logits=len(drafts) > 0,
                            keep_inputs=len(drafts) > 0)
        accepted, next_token, drafts = sampler.accept(logits, drafts)  # the round's one host sync
        open_step = _Step([token] + drafts, taps)
        token = next_token
        kept = 1
        queue = drafts[:accepted]
        stats.add(len(drafts), accepted, time.perf_counter() - round_start)
        if queue:
            token, queue = queue[0], queue[1:] + [token]


def generate(model: CausalModel, tokenizer: Tokenizer, prompt_ids: list[int], params: SamplingParams,
             cache: SequenceCache, prefill_chunk: int, cancel: threading.Event | None = None,
             checkpoints: tuple[int, ...] = (), on_checkpoint: Callable[[int], None] | None = None,
             drafter: Drafter | None = None, draft_tokens: int = 0) -> Iterator[TokenEvent | FinishEvent]:
    """Stream TokenEvents, then one FinishEvent. Closing the iterator, or setting `cancel`, stops the generation.

    The first `cache.length` prompt tokens are already in the cache (a reused prefix) and are not run again.
    At the end `cache.length` counts tokens of prompt + output, and the stop token that ended the output when it
    was fed (`FinishEvent.stop_token_id`), so a caller can keep the cache for the next turn. The prefill stops at
    each of `checkpoints` (prompt positions) and at the prompt's end to call `on_checkpoint`. With a drafter,
    each round verifies up to `draft_tokens` guesses in one step.
    """
    cached = cache.length
    sampler = Sampler(params, model.geometry.vocab_size, model.device, prompt_ids)
    out = _Output(tokenizer, params, list(prompt_ids), min(params.max_tokens, cache.capacity - len(prompt_ids)))
    stats = SpecStats()
    t1: float | None = None

    def started() -> None:  # the first token's value is on the host: the prefill has ended
        nonlocal t1
        if t1 is None:
            t1 = time.perf_counter()

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
        if drafter is None:
            finish = yield from _decode(model, sampler, cache, out, sampler.pick(logits), cancel, started)
        else:
            token = sampler(logits)
            started()
            finish = yield from _speculate(model, sampler, cache, out, token, step, drafter, draft_tokens, params,
                                           cancel, stats)
        end = time.perf_counter()
    tail = out.matcher.flush() if not out.matcher.stopped else ""
    if tail:
        out.text_parts.append(tail)
        yield TokenEvent(None, tail)
    yield FinishEvent(finish, len(prompt_ids), len(out.ids), out.ids, "".join(out.text_parts),
                      Timings(t1 - t0, end - t1, len(prompt_ids) - cached, max(0, len(out.ids) - 1)),
                      cached_tokens=cached, stop_string=out.matcher.matched,
                      spec=stats if drafter is not None else None, stop_token_id=out.stop_token)
