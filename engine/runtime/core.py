"""The engine core: one loop on one thread moves every request on, a step at a time.

Each step: requests that were cancelled end; waiting ones start while there is room (`Scheduler.admit`); the
scheduler plans the step (every decoding request's row, its drafts included, then prefill chunks under the
step's token budget); the rows run as one batched forward (`run_rows`); one pass over the results picks each
row's tokens, decides each verify step's drafts, and sends the events to the requests' streams. Stop tokens and
strings, the token budget and cancellation are all decided here, between steps.

The loop thread runs while there are requests and ends when there are none (an idle engine holds no thread);
`step()` may also be called directly, which is how `generate` runs one sequence on the caller's thread."""
from __future__ import annotations

import atexit
import logging
import threading
import time
import weakref
from collections.abc import Callable

import torch

from ..models.decoder import Row
from ..models.taps import Taps
from ..tokenizer import Tokenizer
from ..transfer import HostCopy, to_device
from .drafting import Drafter
from .drafts import LoadChoice, promised_tokens
from .logprobs import packed, unpack
from .masks import checked_drafts, constrained
from .request import TokenLogprob
from .sampler import Verdict
from .scheduler import NoRoom, Scheduler, Work
from .sequence import Sequence

log = logging.getLogger("ninfer.engine")
_CORES: weakref.WeakSet[EngineCore] = weakref.WeakSet()


@atexit.register
def _stop_all() -> None:
    """At exit, every loop thread ends its requests and stops before the interpreter goes: a daemon thread cut
    off inside a torch op aborts the process."""
    for core in list(_CORES):
        core.stop()


class EngineCore:
    def __init__(self, model, target, tokenizer: Tokenizer, scheduler: Scheduler,
                 start: Callable[[Sequence], bool], drafter: Drafter | None = None, draft_tokens: int = 0,
                 adaptive_drafts: bool = False, fork: Callable[[Sequence, Sequence], bool] | None = None) -> None:
        """`model` runs eager steps of any rows; `target` is the model or the CUDA-graph runner in front of it
        (`runner.py`); `start(seq)` admits a request (its cache and blocks), False when there is no room yet;
        `fork(seq, first)` admits a further choice of a request for several from the first one's cache as its
        prefill ends (`Sequence.forks`), False when there is no room.
        `adaptive_drafts`: each round's drafts follow the request's acceptance and the load (`drafts.py`)."""
        self.model, self.target, self.tokenizer = model, target, tokenizer
        self.scheduler, self._start, self._start_fork = scheduler, start, fork
        self.drafter, self.draft_tokens = drafter, draft_tokens
        self.load_choice = LoadChoice() if adaptive_drafts and drafter is not None else None
        self._drafting = True  # this step's choice
        self.device = model.device
        self._thread: threading.Thread | None = None
        self._news = 0  # requests added and cancels so far: a loop with nothing to run waits for the next
        _CORES.add(self)
        self.steps = 0
        self.prefilled = 0  # prompt tokens run, every request's
        self.drafted = self.accepted = 0  # drafts verified and accepted, every request's
        self.batched_steps = 0  # steps that ran several requests' rows
        self.preemptions = 0  # requests taken off the running ones to free KV blocks (`_room`)
        self._forked: list[Sequence] = []  # further choices started in this step (`_fork`)
        self.largest_batch = 1

    # ---- other threads -----------------------------------------------------------------------------------

    def add(self, seq: Sequence) -> None:
        """Queue a request (Overloaded when the queue is full) and make sure the loop runs."""
        with self.scheduler.lock:
            self.scheduler.add(seq)
            self._news += 1
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name="ninfer-core", daemon=True)
                self._thread.start()
            self.scheduler.lock.notify_all()

    def cancel(self, seq: Sequence) -> None:
        seq.cancelled.set()
        self.wake()

    def wake(self) -> None:
        """Make the loop look at the queue again (a waiting request became ready to start)."""
        with self.scheduler.lock:
            self._news += 1
            self.scheduler.lock.notify_all()

    def stop(self, timeout: float = 30.0) -> None:
        """Cancel every request and wait for the loop thread to end."""
        with self.scheduler.lock:
            for seq in [*self.scheduler.waiting, *self.scheduler.running]:
                for s in (seq, *seq.forks):
                    s.cancelled.set()
            self._news += 1
            self.scheduler.lock.notify_all()
            thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)

    def _loop(self) -> None:
        lock = self.scheduler.lock
        try:
            while True:
                with lock:
                    if not self.scheduler.waiting and not self.scheduler.running:
                        self._thread = None
                        return
                    seen = self._news
                if not self.step():
                    with lock:  # what is left waits for room that only a new request or a cancel changes
                        if self._news == seen and (self.scheduler.waiting or self.scheduler.running):
                            lock.wait()
        except BaseException:
            with lock:
                self._thread = None
            raise

    # ---- the loop thread -----------------------------------------------------------------------------------

    def step(self) -> bool:
        """One step; False when nothing could run."""
        works: list[Work] | None = None
        self._forked = []
        try:
            self._end_cancelled()
            for seq in self.scheduler.admit(self._admit):  # caches and tables made here outlive inference mode
                if self.drafter is not None and seq.cache is not None:
                    with torch.inference_mode():
                        self.drafter.prepare(seq.cache)
            decoding = sum(not s.prefilling for s in self.scheduler.running)
            if self.load_choice is not None:
                promised = sum(promised_tokens(s.acceptance, self.draft_tokens if s.params.speculate else 0)
                               for s in self.scheduler.running if not s.prefilling)
                self._drafting = self.load_choice.drafting(decoding, promised)
            start = time.perf_counter()
            with torch.inference_mode():
                works = self._room(self.scheduler.plan(self._propose))
                if not works:
                    return False
                self.prefilled += sum(w.tokens for w in works if w.prefill)
                results = run_rows(self.model, self.target, works, self.drafter)
                self._update(works, results)
            if self.load_choice is not None and decoding and not any(w.prefill for w in works):
                # a step that chose to draft but got no drafts (no n-gram match) ran as a plain one
                self.load_choice.record(decoding, any(len(w.drafts) for w in works), time.perf_counter() - start)
        except BaseException as exc:  # noqa: BLE001 - the step's requests fail with it; the others go on
            failed = [w.seq for w in works] if works is not None else list(self.scheduler.running)
            for seq in [*failed, *self._forked]:  # further choices started this step are in no work
                if not seq.finished:
                    self._end(seq, exc)
            if not isinstance(exc, Exception):
                raise
        self.steps += 1
        if works is not None and len(works) > 1:
            self.batched_steps += 1
            self.largest_batch = max(self.largest_batch, len(works))
        return True

    def _room(self, works: list[Work]) -> list[Work]:
        """KV blocks for every work's tokens before the step runs. Where the pool has none left for a request
        admitted elastically (`Engine._claim`), the newest such running request is preempted and its work leaves
        the step, until the others' fit: the oldest requests keep going, and each preempted one resumes later
        from its held copy (the host tier, when there is one) or by prefilling its prompt and output again."""
        todo, ready = list(works), []
        while todo:
            w = todo[0]
            try:
                _fit(w)
            except NoRoom:
                victim = next(s for s in reversed(self.scheduler.running) if s.elastic)
                self._preempt(victim)
                todo = [k for k in todo if k.seq is not victim]
                ready = [k for k in ready if k.seq is not victim]
                continue
            ready.append(todo.pop(0))
        return ready

    def _preempt(self, seq: Sequence) -> None:
        """Give back what a running request holds, kept as a held conversation of its prompt and output so far,
        and queue it again first: its stream sees nothing of it."""
        release, seq.release = seq.release, None
        try:
            if release is not None:
                with torch.inference_mode(False):  # a held conversation's tables are used outside it
                    release(seq, True)
        except Exception:  # noqa: BLE001 - the request resumes by prefilling again
            log.exception("holding a preempted request's cache failed")
        seq.preempted()
        self.scheduler.requeue(seq)
        self.preemptions += 1

    def _admit(self, seq: Sequence) -> bool:
        if seq.cancelled.is_set():
            return False  # it leaves the queue at the next step's `_end_cancelled`
        try:
            return self._start(seq)
        except Exception as exc:  # noqa: BLE001 - a request that cannot start fails alone
            self.scheduler.leave(seq)
            seq.finished = True
            seq.emit(exc)
            self._orphaned(seq, exc)
            self.wake()  # the queue changed: a loop with nothing left to run must look at the next one, not wait
            return False

    def _end_cancelled(self) -> None:
        with self.scheduler.lock:
            gone = [s for s in self.scheduler.waiting if s.cancelled.is_set()]
            for s in gone:
                self.scheduler.waiting.remove(s)
        for s in gone:
            if s.loading is not None:  # a disk read not begun is not needed any more
                s.loading.cancel()
            if s.out is not None:  # preempted: it ends with what it output
                s.finish("cancelled", self.drafter is not None)
            else:
                s.never_ran()
            self._orphaned(s, "cancelled")
        for s in [s for s in self.scheduler.running if s.cancelled.is_set()]:
            self._end(s, "cancelled")

    def _end(self, seq: Sequence, reason: str | BaseException) -> None:
        """Finish a request: what it took goes back (kept as a held conversation when it ended normally), then
        its last events, so a client that sends its next turn at once finds this one held. A failure to give
        something back is logged; the request still ends."""
        self.scheduler.leave(seq)
        self._orphaned(seq, reason)
        try:
            if seq.release is not None:
                with torch.inference_mode(False):  # a held conversation's tables are used outside it
                    seq.release(seq, reason in ("stop", "length"))
        except Exception:  # noqa: BLE001 - the request's own end must still reach its stream
            log.exception("giving back a finished request's cache failed")
        seq.release = None
        if isinstance(reason, BaseException):
            seq.finished = True
            seq.emit(reason)
        else:
            seq.finish(reason, self.drafter is not None)

    def _propose(self, seqs: list[Sequence]) -> list[tuple[list[int] | torch.Tensor, bool]]:
        """The decoding requests' drafts for the next step, and whether each one's row runs as a verify row: with
        drafts, and under a grammar also when the grammar refused them all. On a GPU a plain step computes its row
        with other kernels than a verify step (each row count its own tuned choice), and their last-bit
        differences can flip a greedy pick at a near tie: the grammar's refusals would then change the output.
        The drafter guesses for every drafting request in one call (`draft_rows`)."""
        if self.drafter is None:
            return [([], False)] * len(seqs)
        counts = [self._draft_count(seq) for seq in seqs]
        now = time.perf_counter()
        for seq in seqs:
            seq.round_start = now
        drafting = [i for i, k in enumerate(counts) if k]
        drafts: list[list[int] | torch.Tensor] = [[] for _ in seqs]
        if drafting:
            guesses = draft_rows(self.target, self.drafter, [seqs[i] for i in drafting],
                                 [counts[i] for i in drafting])
            for i, g in zip(drafting, guesses, strict=True):
                drafts[i] = g[:counts[i]]
        out = []
        for seq, k, d in zip(seqs, counts, drafts, strict=True):
            if seq.matcher is not None and k:
                out.append((checked_drafts(seq.matcher, d), True))
            else:
                out.append((d, len(d) > 0))
        return out

    def _draft_count(self, seq: Sequence) -> int:
        """How many drafts a decoding request's next round verifies (0: a plain decode row)."""
        if not (seq.params.speculate and self._drafting):
            return 0
        cache, out = seq.cache, seq.out
        most = self.draft_tokens if self.load_choice is None else seq.acceptance.drafts(self.draft_tokens)
        return max(0, min(most, out.budget - len(out.ids) - 1, cache.capacity - cache.length - 1))

    def _update(self, works: list[Work], results: list[tuple[torch.Tensor, Taps | None]]) -> None:
        """The step's picks: decode rows' and finished prefills' tokens (and their logprobs) and verify steps'
        verdicts, all made on the device first and read in one copy, so a step of several requests waits for
        the device once. A finished prefill starts the request's further choices (`_fork`), which pick their
        first tokens from the same logits."""
        picks: list[tuple[Sequence, torch.Tensor, torch.Tensor | None]] = []
        verdicts: list[tuple[Work, Taps | None, Verdict]] = []
        in_turn: list[tuple[Work, Taps | None, tuple]] = []  # rounds decided row by row
        for w, (logits, taps) in zip(works, results, strict=True):
            seq = w.seq
            if w.prefill:
                stop = seq.cache.length
                seq.reached(stop)
                speculates = self.drafter is not None and seq.params.speculate  # the others' drafts never come
                if stop < len(seq.fed_ids):
                    if speculates:
                        self.drafter.observe(seq.cache, w.ids[w.seen:], taps, seq.fed_ids[stop])
                    continue
                seq.last_chunk = (w.ids[w.seen:], taps) if speculates else None
                for s in (seq, *self._fork(seq)):
                    picks += self._alone(s, _pick, s, logits[-1:])
            elif self.drafter is None or not seq.params.speculate:  # a plain row, as without a drafter
                picks += self._alone(seq, _pick, seq, logits[-1:])
            else:  # made on the device for the step's one read; None where a repetition penalty decides row by row
                for verified in self._alone(seq, _verified, w, logits):
                    for verdict in self._alone(seq, seq.sampler.verdict, *verified):
                        if verdict is None:
                            in_turn.append((w, taps, verified))
                        else:
                            verdicts.append((w, taps, verdict))
        # after every verdict is made: their rounds' drafter updates replay graphs whose memory pool may hold the
        # drafts the verdicts read
        for w, taps, verified in in_turn:
            self._alone(w.seq, self._round_in_turn, w, taps, verified)
        if not picks and not verdicts:
            return
        parts = [torch.stack([t for _, t, _ in picks]).double()] if picks else []
        parts += [p for _, _, p in picks if p is not None] + [v.values for _, _, v in verdicts]
        values = HostCopy(torch.cat(parts) if len(parts) > 1 else parts[0]).result().tolist()
        at = len(picks)
        for i, (seq, _, pack) in enumerate(picks):
            logprob = None
            if pack is not None:
                logprob = unpack(values[at:at + pack.numel()], seq.params.logprobs)[0]
                at += pack.numel()
            self._alone(seq, self._picked, seq, int(values[i]), logprob)
        for w, taps, verdict in verdicts:
            n = verdict.values.numel()
            self._alone(w.seq, self._round, w, taps, *verdict.read(values[at:at + n]))
            at += n

    def _alone(self, seq: Sequence, fn: Callable, *args) -> list:
        """fn(*args) for one request; an error it raises (its grammar refusing a token, say) ends that request
        alone, not every request in the step. Returns [fn's result], or [] when it failed."""
        try:
            return [fn(*args)]
        except Exception as exc:  # noqa: BLE001 - one request's failure is its own
            if not seq.finished:
                self._end(seq, exc)
            return []

    def _fork(self, first: Sequence) -> list[Sequence]:
        """The further choices of a request for several, started as its first one's prefill ends: each continues
        from a fork of its cache (`fork`). One that finds no room waits in the queue and prefills alone."""
        forks, first.forks, started, waiting = first.forks, [], [], []
        for seq in forks:
            if seq.cancelled.is_set():
                seq.never_ran()
                continue
            try:
                with torch.inference_mode(False):  # caches and tables made here outlive inference mode
                    ok = (len(self.scheduler.running) < self.scheduler.max_running
                          and self._start_fork(seq, first))
            except Exception as exc:  # noqa: BLE001 - a choice that cannot start fails alone
                seq.finished = True
                seq.emit(exc)
                continue
            if not ok:
                waiting.append(seq)
                continue
            with self.scheduler.lock:
                self.scheduler.running.append(seq)
            self._forked.append(seq)
            if self.drafter is not None and not self._alone(seq, self.drafter.prepare, seq.cache):
                continue
            started.append(seq)
        with self.scheduler.lock:
            self.scheduler.waiting.extendleft(reversed(waiting))
        return started

    def _orphaned(self, seq: Sequence, reason: str | BaseException) -> None:
        """A request for several choices ended before its prefill did: its further choices fail with it, end
        when cancelled too, else wait at the queue's head to prefill alone."""
        forks, seq.forks = seq.forks, []
        alive = []
        for f in forks:
            if isinstance(reason, BaseException):
                f.finished = True
                f.emit(reason)
            elif f.cancelled.is_set():
                f.never_ran()
            else:
                alive.append(f)
        with self.scheduler.lock:
            self.scheduler.waiting.extendleft(reversed(alive))

    def _picked(self, seq: Sequence, token: int, logprob: TokenLogprob | None) -> None:
        """A plain pick (decode, or the first token after the prompt)."""
        if seq.last_chunk is not None:  # set only where a drafter speculates for it
            ids, taps = seq.last_chunk
            self.drafter.observe(seq.cache, ids, taps, token)
        seq.last_chunk = None
        finish = seq.output(token, logprob)
        if finish is not None:
            self._end(seq, finish)
        else:
            seq.pending = token

    def _round_in_turn(self, w: Work, taps: Taps | None, verified: tuple) -> None:
        """A round whose sampler decides row by row (`_verified`'s arguments), reading the device as it goes."""
        self._round(w, taps, *w.seq.sampler.accept_with(*verified))

    def _round(self, w: Work, taps: Taps | None, accepted: int, nxt: int, drafts: list[int],
               extra: list[float]) -> None:
        """A speculative round's end: the drafts the target keeps are output, then its own pick; the cache keeps
        the fed tokens the output reached and the drafter sees them."""
        seq, top = w.seq, w.seq.params.logprobs
        logprobs = unpack(extra, top) if top is not None else None
        seq.stats.add(len(drafts), accepted, time.perf_counter() - seq.round_start)
        if drafts:
            seq.acceptance.add(len(drafts), accepted)
            self.drafted, self.accepted = self.drafted + len(drafts), self.accepted + accepted
        fed = w.ids + drafts
        out = [*drafts[:accepted], nxt]
        kept, finish = 1, None
        for i, token in enumerate(out):
            before = len(seq.out.ids)
            finish = seq.output(token, logprobs[i] if logprobs is not None else None)
            if i < accepted and len(seq.out.ids) > before:
                kept += 1  # a draft that was output (not a refused stop token): the cache keeps it
            if finish is not None:
                break
        seq.cache.commit(len(fed), kept)
        following = ([w.ids[0], *drafts[:accepted], nxt])[kept]
        self.drafter.observe(seq.cache, fed[:kept], taps.first(kept) if taps is not None else None,
                             following)
        if finish is not None:
            self._end(seq, finish)
        else:
            seq.pending = nxt


def _fit(w: Work) -> None:
    """KV blocks for a work's tokens (NoRoom where the pool has none). A verify row whose drafts would need a block
    the pool cannot give keeps the drafts its blocks hold: drafts are guesses, and preempting another request (or
    itself, just resumed, which would then prefill all it holds again) for them would cost more than they save."""
    cache = w.seq.cache
    try:
        cache.ensure(cache.length + w.tokens)
    except NoRoom:
        if not len(w.drafts):
            raise
        cache.ensure(cache.length + len(w.ids))
        w.drafts = w.drafts[:cache.kv.capacity - cache.length - len(w.ids)]


def _verified(w: Work, logits: torch.Tensor) -> tuple[torch.Tensor, list[int] | torch.Tensor, Callable | None]:
    """A verify step's logits under the request's grammar, its drafts, and what its logprobs read of each chosen
    token: the sampler's verdict's arguments."""
    seq, top = w.seq, w.seq.params.logprobs
    rider = None if top is None else (lambda chosen: packed(logits[:chosen.shape[0]], chosen, top))
    masked = constrained(logits, seq.matcher, w.drafts) if seq.matcher is not None else logits
    return masked, w.drafts, rider


def _pick(seq: Sequence, logits: torch.Tensor) -> tuple[Sequence, torch.Tensor, torch.Tensor | None]:
    """A plain pick from logits [1, vocab] (the grammar's mask applied first): the token on the device, and its
    logprobs packed when the request asks (from the raw logits, `logprobs.py`)."""
    masked = constrained(logits, seq.matcher, []) if seq.matcher is not None else logits
    token = seq.sampler.pick(masked[-1])
    top = seq.params.logprobs
    return seq, token, None if top is None else packed(logits, token.view(1), top)


def draft_rows(target, drafter: Drafter, seqs: list[Sequence], counts: list[int]) -> list[list[int] | torch.Tensor]:
    """The drafter's guesses for these requests (counts[i] for seqs[i]) in one call. A drafter with graphs makes
    them in one call where the graph runner's lanes 0..B-1 cover their caches (`draft_lanes`): the call is over
    those lanes, free ones padding it with no guesses, so it replays its captured batch graph."""
    caches, histories = [s.cache for s in seqs], [s.out.history for s in seqs]
    if len(seqs) == 1 or drafter.graphs is None:
        return drafter.propose_rows(caches, histories, counts)
    lanes = target.draft_lanes(caches)
    if lanes is None:  # no captured batch covers them: each alone (its lane's graphs), not a graph per set
        return [drafter.propose_rows([c], [h], [k])[0] for c, h, k in zip(caches, histories, counts, strict=True)]
    at = {id(c): i for i, c in enumerate(caches)}
    rows = [at.get(id(c)) for c in lanes]
    got = drafter.propose_rows(lanes, [histories[i] if i is not None else None for i in rows],
                               [counts[i] if i is not None else 0 for i in rows])
    out: list[list[int] | torch.Tensor] = [[] for _ in seqs]
    for i, guesses in zip(rows, got, strict=True):
        if i is not None:
            out[i] = guesses
    return out


def run_rows(model, target, works: list[Work], drafter: Drafter | None) -> list[tuple[torch.Tensor,
                                                                                    Taps | None]]:
    """Run a step's rows: logits of each work's rows (its last one, or all of a verify step's) and the drafter's
    taps of its rows. The target (the model, or the CUDA-graph runner in front of it) runs them as one step;
    a short prefill chunk of a lane runs as the graph runner's graphed pieces (`_pieces`; another cache has no
    graphs, and its pieces would only run eagerly one after another). The drafter's taps are taken where a row
    speculates, or sits in a lane (its graphs were captured with the taps: a step without would run eagerly)."""
    for w in works:
        w.seq.cache.ensure(w.seq.cache.length + w.tokens)
    pieces = [w for w in works if w.prefill and target.graphed(w.seq.cache) and target.prefill_piece(w.tokens)]
    batched = [w for w in works if w not in pieces]
    out: dict[int, tuple[torch.Tensor, Taps | None]] = {id(w): _pieces(target, w, drafter) for w in pieces}
    if batched:
        wanted = drafter is not None and any(
            w.seq.params.speculate or target.graphed(w.seq.cache) for w in batched)
        taps = drafter.taps() if wanted else None
        ids = torch.cat([_ids(w, model.device) for w in batched])
        if len(batched) == 1:
            w = batched[0]
            logits = target.forward(ids, w.seq.cache, all_logits=w.keep, taps=taps, keep_inputs=w.keep)
        else:
            logits = target.forward_rows(ids, [Row(w.seq.cache, w.tokens, w.keep, w.keep) for w in batched],
                                         taps=taps)
        first = row = 0
        for w in batched:
            n = w.tokens if w.keep else 1
            out[id(w)] = (logits[row:row + n], taps.rows(first, first + w.tokens) if taps is not None
                          else None)
            first, row = first + w.tokens, row + n
    return [out[id(w)] for w in works]


def _ids(w: Work, device: torch.device) -> torch.Tensor:
    if isinstance(w.drafts, torch.Tensor):  # guesses made on the device stay there: no sync before verify
        return torch.cat([to_device(w.ids, device), w.drafts])
    return to_device(w.ids + list(w.drafts), device)


def _pieces(target, w: Work, drafter: Drafter | None) -> tuple[torch.Tensor, Taps | None]:
    """A short prefill chunk as the graph runner's pieces: steps that keep their recurrent inputs, each
    committed whole; the drafter sees each piece but the last as it goes (the last one the caller shows it)."""
    cache, ids = w.seq.cache, w.ids
    size = target.prefill_piece(len(ids))
    logits = taps = None
    for start in range(0, len(ids), size):
        piece = ids[start:start + size]
        taps = drafter.taps() if drafter is not None else None
        logits = target.forward(to_device(piece, target.device), cache, taps=taps, keep_inputs=True)
        cache.commit(len(piece), len(piece))
        w.seen = start
        if drafter is not None and w.seq.params.speculate and start + size < len(ids):
            drafter.observe(cache, piece, taps, ids[start + size])
    return logits, taps
