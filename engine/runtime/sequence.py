"""A request inside the engine core: data the step loop moves on, never a thread. It waits, prefills its prompt
in chunks, then decodes one token a step or verifies its drafts a step, and ends with one FinishEvent; each
event goes to its stream's queue as soon as the step that made it ends."""
from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future

import torch

from ..cache.sequence import SequenceCache
from ..media.prompt import PromptMedia
from ..models.taps import Taps
from ..tokenizer import Tokenizer
from ..tokenizer.grammar import Matcher
from .drafts import Acceptance
from .output import Output
from .request import FinishEvent, SamplingParams, SpecStats, Timings, TokenEvent, TokenLogprob
from .sampler import Sampler

Event = TokenEvent | FinishEvent | BaseException  # an exception: the request failed, its stream raises it


class Sequence:
    def __init__(self, prompt_ids: list[int], params: SamplingParams, checkpoints: tuple[int, ...] = (),
                 on_checkpoint: Callable[[Sequence, int], None] | None = None, matcher: Matcher | None = None,
                 media: PromptMedia | None = None) -> None:
        self.prompt_ids, self.params = prompt_ids, params
        # What the cache must hold before the next pick: the prompt, or after a preemption the prompt and the
        # output so far (`preempted`), which the request prefills again where no held copy serves it.
        self.fed_ids = prompt_ids
        self.out: Output | None = None  # made at the first start, kept through preemptions
        self.elastic = False  # admitted with an elastic claim: the core may preempt it (`EngineCore._room`)
        self.media = media  # the prompt's images (their embeddings, M-RoPE positions and keys)
        self.matcher = matcher  # its grammar's place: each output token advances it
        self.checkpoints, self.on_checkpoint = checkpoints, on_checkpoint
        self.events: queue.SimpleQueue[Event] = queue.SimpleQueue()
        self.cancelled = threading.Event()
        self.cache: SequenceCache | None = None
        self.release: Callable[[Sequence, bool], None] | None = None  # gives back what admission took; True: hold
        self.finished = False
        self.pending: int | None = None  # the token output last and fed next (decoding)
        # The last prefill step's tokens and the drafter's taps of them: the drafter observes them once the
        # token after them is known (the first pick).
        self.last_chunk: tuple[list[int], Taps | None] | None = None
        self.stats = SpecStats()
        self.round_start = 0.0  # when its current speculative round began (drafting included)
        self.acceptance = Acceptance()  # its recent drafts, which set how many the next round verifies
        self.snapshots: dict[int, object] = {}  # recurrent-state checkpoints taken in the prefill, by position
        # A request for several choices: the further ones, which start from this one's cache as its prefill ends
        # (`EngineCore._fork`) instead of prefilling the same prompt again.
        self.forks: list[Sequence] = []
        # A held conversation on its way from the disk tier: the request waits in the queue until it is read
        # (`Engine._loaded`), off the step loop.
        self.loading: Future | None = None

    def start(self, cache: SequenceCache, tokenizer: Tokenizer, vocab_size: int, device: torch.device) -> None:
        """Admitted: `cache` holds the reused prefix of the prompt (or nothing). A preempted request starts again
        with its output, sampler and timings as they were."""
        self.cache = cache
        if self.out is None:
            prompt = self.prompt_ids
            self.cached = cache.length
            self.sampler = Sampler(self.params, vocab_size, device, prompt)
            self.out = Output(tokenizer, self.params, list(prompt), min(self.params.max_tokens,
                                                                        cache.capacity - len(prompt)))
            self.t0, self.t1 = time.perf_counter(), None
        fed = self.fed_ids
        # where prefill steps end: the checkpoints still ahead, and the end of what it feeds
        self.stops = sorted({p for p in self.checkpoints if cache.length <= p < len(fed)} | {len(fed)})
        self.reached(cache.length)

    @property
    def remaining(self) -> int:
        """Tokens it may still output."""
        return self.params.max_tokens if self.out is None else self.out.budget - len(self.out.ids)

    def preempted(self) -> None:
        """Taken off the running requests to free KV blocks (its cache given back, held where held conversations
        are kept): its next start feeds the prompt and the output so far, then picks on."""
        self.fed_ids = self.prompt_ids + self.out.ids
        self.cache, self.pending, self.last_chunk = None, None, None

    @property
    def keys(self) -> list[int]:
        """What it feeds as held conversations match it: its ids, with each image pad keyed by its image."""
        return self.media.keys if self.media is not None else self.fed_ids

    @property
    def history(self) -> list[int]:
        """Its prompt (as `keys`) and its output: what a held conversation of it holds."""
        return self.keys[:len(self.prompt_ids)] + self.out.ids

    @property
    def prefilling(self) -> bool:
        return self.pending is None

    def next_stop(self) -> int:
        """Where the prefill's next step must end at the latest: the next checkpoint or the prompt's end."""
        return self.stops[0]

    def reached(self, position: int) -> None:
        """The prefill has reached `position`: a checkpoint there is taken (the prompt's end is one too; the end of
        a resumed request's prompt and output so far is none: no later prompt leaves its conversation there, and
        each such copy of the recurrent state would stay with it, one more for every resumption)."""
        if self.stops and self.stops[0] == position:
            self.stops.pop(0)
            if self.on_checkpoint is not None and position <= len(self.prompt_ids):
                self.on_checkpoint(self, position)

    def emit(self, event: Event) -> None:
        self.events.put(event)

    def output(self, token: int, logprob: TokenLogprob | None = None) -> str | None:
        """Output `token` (the first pick, a decode pick, an accepted draft or a verify step's own pick), with its
        logprob when the request asked: the finish reason when the output ends with it or before it (a stop
        token, which is not output)."""
        if self.t1 is None:
            self.t1 = time.perf_counter()
        if self.out.refuses(token):
            return "stop"
        self.emit(self.out.push(token, logprob))
        if self.matcher is not None and self.matcher.advance(token):
            return "stop"  # the grammar is complete: nothing but its end may follow
        return self.out.full

    def finish(self, reason: str, spec: bool) -> None:
        """The last events: the text a stop string held back, then the FinishEvent."""
        self.finished = True
        out = self.out
        tail = out.tail()
        if tail is not None:
            self.emit(tail)
        end = time.perf_counter()
        t1 = self.t1 if self.t1 is not None else end
        self.emit(FinishEvent(reason, len(self.prompt_ids), len(out.ids), out.ids, "".join(out.text_parts),
                              Timings(t1 - self.t0, end - t1, len(self.prompt_ids) - self.cached,
                                      max(0, len(out.ids) - 1)),
                              cached_tokens=self.cached, stop_string=out.matcher.matched,
                              spec=self.stats if spec else None, stop_token_id=out.stop_token,
                              logprobs=out.logprobs))

    def never_ran(self, reason: str = "cancelled") -> None:
        """The end of a request that ended before it was admitted."""
        self.finished = True
        self.emit(FinishEvent(reason, len(self.prompt_ids), 0, [], "", Timings(0.0, 0.0, 0, 0)))
