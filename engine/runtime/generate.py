"""One sequence through the engine core on the caller's thread: the core's own steps over a cache the caller
gives (benchmarks, profiles and the oracle tests drive a model this way, without an Engine)."""
from __future__ import annotations

import threading
from collections.abc import Callable, Iterator

from ..cache.sequence import SequenceCache
from ..tokenizer import Tokenizer
from ..tokenizer.grammar import GrammarCompiler
from .core import EngineCore
from .drafting import Drafter
from .request import FinishEvent, SamplingParams, TokenEvent
from .scheduler import Scheduler
from .sequence import Sequence


def generate(model, tokenizer: Tokenizer, prompt_ids: list[int], params: SamplingParams, cache: SequenceCache,
             prefill_chunk: int, cancel: threading.Event | None = None, checkpoints: tuple[int, ...] = (),
             on_checkpoint: Callable[[int], None] | None = None, drafter: Drafter | None = None,
             draft_tokens: int = 0) -> Iterator[TokenEvent | FinishEvent]:
    """Stream TokenEvents, then one FinishEvent. Closing the iterator, or setting `cancel`, stops the generation.

    `model` is a model or a CUDA-graph runner in front of one. The first `cache.length` prompt tokens are already
    in the cache (a reused prefix) and are not run again. At the end `cache.length` counts the tokens of prompt
    and output the cache holds, so a caller can keep it for the next turn. The prefill stops at each of
    `checkpoints` (prompt positions) and at the prompt's end to call `on_checkpoint`. With a drafter, each round
    verifies up to `draft_tokens` guesses in one step.
    """
    matcher = (GrammarCompiler(tokenizer, model.geometry.vocab_size).matcher(params.grammar)
               if params.grammar is not None else None)
    seq = Sequence(list(prompt_ids), params, checkpoints,
                   (lambda _seq, pos: on_checkpoint(pos)) if on_checkpoint is not None else None, matcher)

    def start(s: Sequence) -> bool:
        s.start(cache, tokenizer, model.geometry.vocab_size, model.device)
        return True

    core = EngineCore(getattr(model, "model", model), model, tokenizer, Scheduler(1, 0, prefill_chunk), start,
                      drafter, draft_tokens)
    with core.scheduler.lock:
        core.scheduler.add(seq)
    try:
        while True:
            while not seq.events.empty():
                event = seq.events.get()
                if isinstance(event, BaseException):
                    raise event
                yield event
                if isinstance(event, FinishEvent):
                    return
            if cancel is not None and cancel.is_set():
                seq.cancelled.set()
            core.step()
    finally:
        if not seq.finished:  # closed early: the sequence ends here, its cache as far as it got
            seq.cancelled.set()
            core.step()
