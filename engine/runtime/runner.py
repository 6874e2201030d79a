"""CUDA graphs of the decode/verify step, captured once per step size and lane and replayed each step: one launch
instead of the ~1,500 kernel launches (and their Python) of an eager step.

A graph reads its inputs from static buffers (token ids, positions) and writes to static outputs (logits, the
drafter's hidden states, the GDN inputs a verify step keeps for its commit), so it is bound to one cache's tensors:
the engine runs every request in a lane (`lanes.py`), a working cache whose block table (read by the graphs) the
request fills with its KV blocks from the pool, a held conversation's among them. Per lane: T = 1 (plain decode),
T = K+1 (a verify step; one with fewer drafts pads to K+1, its extra positions write KV past the sequence's end, which
the next step overwrites, or into the pool's scratch block, and roll back like rejected drafts) and T = 16, the
prefill piece: a short prefill chunk (a chat turn's few new tokens) runs as padded 16-token steps that keep their
GDN inputs, committed like a verify step whose drafts were all accepted. Eagerly, such a chunk costs ~2,800 kernel
launches whose host time is several times the device's. Per batch bucket
B: one decode token for each of lanes 0..B-1 in one step, the weights read once for all (with the drafter's taps:
a speculating request's plain steps, where drafts do not pay at the load, feed its drafter); with drafts, also a verify
step of K+1 tokens for each of lanes 0..B-1 (several requests' rounds in one step: a row with fewer drafts pads,
a plain decode row runs as a verify row with none). With a drafter that replays
graphs of its own, per lane also the drafter's: its step over each count of kept tokens and its draft of each
length, so no request's rounds stall on a capture (whose warm-up runs also time matmul tiles for new row counts).
Anything else (longer prefill chunks, caches outside the lanes, a prompt's steps over its images) runs eagerly
through the model. Past a prompt with images a token turns by its place + the prompt's M-RoPE delta: a model that
reads images captures its graphs with a per-row delta buffer added to the positions for the rotary embedding.
"""
from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from ..cache.kv_pool import KVPool
from ..cache.sequence import SequenceCache
from ..cuda_graphs import MAX_GRAPH_TOKENS
from ..cuda_graphs import capture as capture_graph
from ..models.decoder import Row
from ..models.taps import Taps
from ..transfer import to_device
from .drafting import Drafter
from .lanes import Lanes, batch_bucket, batch_buckets

PREFILL_PIECE = 16  # tokens per graphed prefill step: the most the decode matmuls and the conv kernel take


@contextmanager
def kept_lengths(caches: list[SequenceCache]) -> Iterator[None]:
    """The caches' lengths as they were before a captured call (the warm-up runs would move them on; the
    runner sets them after each replay)."""
    lengths = [c.length for c in caches]
    try:
        yield
    finally:
        for c, n in zip(caches, lengths, strict=True):
            c.length = n


def in_media_prompt(cache: SequenceCache) -> bool:
    """Whether the cache's next step is within its prompt's images (their embeddings and 3-axis positions)."""
    return cache.media is not None and cache.length < cache.media.positions.shape[1]


def rope_delta(cache: SequenceCache) -> int:
    """How far past its place in the cache a token past the prompt turns (M-RoPE after images; 0 without)."""
    return cache.media.delta if cache.media is not None else 0


@dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph
    ids: torch.Tensor  # [T] static input (B in a batch graph)
    positions: torch.Tensor  # [T] static input (each lane's length in a batch graph)
    logits: torch.Tensor  # [1 or T, vocab] ([B, vocab]; [B * T, vocab] in a batch verify graph)
    taps: Taps | None  # static hidden states a drafter reads
    kept: object | None  # the KeptInputs a verify step keeps (static; one per lane in a batch verify graph)
    # a model that reads images: the M-RoPE delta of each row's sequence past its prompt (static, added to the
    # positions inside the graph for the rotary embedding alone), and the deltas it holds, on the host
    shifts: torch.Tensor | None = None
    held: list[int] | None = None

    def rope(self) -> torch.Tensor | None:
        """The positions the rotary embedding turns by, computed inside the graph."""
        return self.positions + self.shifts if self.shifts is not None else None

    def shift(self, deltas: list[int], device: torch.device) -> None:
        """Set each row's delta where it changed (a lane's next request): no copy while they stay."""
        if deltas != self.held:
            self.shifts.copy_(to_device(deltas, device))
            self.held = deltas


class GraphRunner:
    """The model's `forward` and `forward_batch`, replaying a captured graph where one fits the step."""

    def __init__(self, model, lanes: Lanes, sizes: tuple[int, ...], drafter: Drafter | None = None,
                 prefill_tokens: int = 0, images: bool = False) -> None:
        """`sizes`: the decode/verify step sizes (a verify step's is the drafter's K + 1); `drafter`: the one whose
        hidden states the verify steps keep, and whose graphs are captured too; `prefill_tokens`: the longest
        prefill chunk that runs as graphed pieces (0: none, and no piece graph is captured); `images`: requests
        may send images, whose sequences' steps past their prompt replay the graphs with their M-RoPE delta
        (their prompt's steps run eagerly: the tower's embeddings and 3-axis positions)."""
        self.prefill_tokens, self.images = prefill_tokens, images
        self.draft_tokens = max(sizes) - 1
        if prefill_tokens:
            sizes = (*sizes, PREFILL_PIECE)
        self.model, self.lanes, self.sizes = model, lanes, tuple(sorted(set(sizes)))
        self.device, self.geometry = model.device, model.geometry
        self.buckets = batch_buckets(len(lanes))
        self.drafter = drafter
        if drafter is not None and drafter.graphs is not None:
            drafter.graphs.max_bound = len(lanes)  # each lane keeps its drafter graphs
        self._graphs: dict[tuple[int, int], _Graph] = {}  # (lane, T)
        self._batches: dict[int, _Graph] = {}  # B
        self._verifies: dict[int, _Graph] = {}  # B, each lane's K+1 tokens
        self._arange = torch.arange(max(self.sizes), device=self.device)
        self._pool = torch.cuda.graph_pool_handle()
        self.replays = 0
        self.batch_replays = 0
        self.verify_replays = 0

    @property
    def captured(self) -> tuple[int, ...]:
        """The step sizes captured for each lane."""
        return tuple(sorted({t for _, t in self._graphs}))

    @property
    def captured_batches(self) -> tuple[int, ...]:
        return tuple(sorted(self._batches))

    @property
    def captured_verifies(self) -> tuple[int, ...]:
        return tuple(sorted(self._verifies))

    def new_cache(self, max_len: int, pool: KVPool | None = None) -> SequenceCache:
        return self.model.new_cache(max_len, pool)

    def prefill_piece(self, tokens: int) -> int:
        """Tokens per step for a prefill chunk of `tokens` tokens: PREFILL_PIECE when the chunk runs as graphed
        pieces (steps that keep their GDN inputs, then `commit`), 0 when it runs eagerly in one step."""
        return PREFILL_PIECE if tokens <= self.prefill_tokens else 0

    def graphed(self, cache: SequenceCache) -> bool:
        """Whether steps on `cache` replay this runner's graphs: a lane's cache past any images of its prompt;
        another runs eagerly."""
        return self.lanes.index(cache) is not None and not in_media_prompt(cache)

    def draft_lanes(self, caches: list[SequenceCache]) -> list[SequenceCache] | None:
        """Lanes 0..B-1 of the smallest batch bucket that covers these caches' lanes and holds no other running
        sequence, whose drafter batch graph serves them (free lanes pad it: their tables map to the scratch
        block); None when the caches are not all lanes or no bucket fits."""
        lanes = [self.lanes.index(c) for c in caches]
        if None in lanes:
            return None
        b = batch_bucket(lanes, self.lanes.busy(), self.buckets)
        return self.lanes.caches[:b] if b is not None else None

    def decode_graph(self, n: int) -> torch.cuda.CUDAGraph:
        """The graph a decode step of lanes 0..n-1 replays (for benchmarks: replayed while no request runs, it
        writes throw-away tokens into free lanes)."""
        if n == 1:
            return self._graphs[0, 1].graph
        return self._batches[batch_bucket(list(range(n)), set(), tuple(self._batches))].graph

    def capture_all(self, progress: Callable[[int, int], None] | None = None) -> None:
        """Capture every lane's sizes, every batch bucket and the drafter's graphs (the lanes must hold no
        sequence: warm-up runs write into them)."""
        jobs = [(lane, size) for lane in range(len(self.lanes)) for size in self.sizes]
        jobs += [(None, b) for b in self.buckets]
        if self.draft_tokens:
            jobs += [("verify", b) for b in self.buckets]
        if self.drafter is not None and self.drafter.graphs is not None and self.draft_tokens:
            jobs += [(lane, "drafter") for lane in range(len(self.lanes))]
            jobs += [("drafts", b) for b in self.buckets]
        for i, (lane, size) in enumerate(jobs):
            if lane is None:
                self._batches[size] = self._capture_batch(size)
            elif lane == "verify":
                self._verifies[size] = self._capture_verify(size)
            elif lane == "drafts":
                self._capture_drafter_batch(size)
            elif size == "drafter":
                self._capture_drafter(self.lanes.caches[lane])
            else:
                self._graphs[lane, size] = self._capture(self.lanes.caches[lane], size)
            if progress is not None:
                progress(i + 1, len(jobs))
        for cache in self.lanes.caches:
            cache.reset()

    def _capture(self, cache: SequenceCache, size: int) -> _Graph:
        verify = size > 1
        ids = torch.zeros(size, dtype=torch.long, device=self.device)
        positions = self._arange[:size].clone()
        taps = self.drafter.taps() if self.drafter is not None else None
        g = _Graph(None, ids, positions, None, taps, None, self._shifts(size))

        def step() -> torch.Tensor:
            with kept_lengths([cache]):
                return self.model.forward(ids, cache, all_logits=verify, taps=taps, keep_inputs=verify,
                                          positions=positions, rope_positions=g.rope())

        with torch.inference_mode():
            g.graph, g.logits = capture_graph(step, self._pool)
        g.kept = cache.kept
        return g

    def _shifts(self, n: int) -> torch.Tensor | None:
        return torch.zeros(n, dtype=torch.long, device=self.device) if self.images else None

    def _capture_drafter(self, cache: SequenceCache) -> None:
        """The drafter's graphs for this lane's table, through its own calls: a step over each count of kept
        tokens a graph takes (a round's, or a short prompt's), then a draft of each length (fewer than K when a
        request's budget runs out). The hidden states it reads are random: the writes land in the pool's scratch
        block, as the lane's own warm-up steps' do."""
        d = self.drafter
        taps = d.taps()
        x = torch.randn(MAX_GRAPH_TOKENS, self.geometry.hidden_size, device=self.device, dtype=self.model.dtype)
        taps.layers = dict.fromkeys(taps.layer_ids, x)
        taps.hidden = x if taps.final else None
        with torch.inference_mode():
            for n in (*range(2, MAX_GRAPH_TOKENS + 1), 1):  # n = 1 last: the drafts follow one observed token
                cache.reset()  # no drafter state (another drafter's may be there), length 0
                d.prepare(cache)
                d.observe(cache, [0] * n, taps.first(n), 0)
            for k in range(1, self.draft_tokens + 1):
                d.propose(cache, [0], k)

    def _capture_drafter_batch(self, b: int) -> None:
        """The drafter's guesses for lanes 0..b-1 at once, through its own call as `draft_lanes` makes it: its
        batch graphs for these lanes' tables, one per draft count (a round's count falls near a request's
        budget or its blocks' end)."""
        caches = self.lanes.caches[:b]
        with torch.inference_mode():
            for cache in caches:
                cache.reset()
                self.drafter.prepare(cache)
            for k in range(1, self.draft_tokens + 1):
                self.drafter.propose_rows(caches, [[0]] * b, [k] * b)

    def _capture_batch(self, b: int) -> _Graph:
        """A decode token for each of lanes 0..b-1, with the drafter's taps where it reads them: a speculating
        request's plain steps (a load that does not pay for drafts) feed its drafter too."""
        caches = self.lanes.caches[:b]
        ids = torch.zeros(b, dtype=torch.long, device=self.device)
        positions = torch.zeros(b, dtype=torch.long, device=self.device)
        taps = self.drafter.taps() if self.drafter is not None else None
        g = _Graph(None, ids, positions, None, taps, None, self._shifts(b))

        def step() -> torch.Tensor:
            with kept_lengths(caches):
                return self.model.forward_batch(ids, caches, positions, g.rope(), taps)

        with torch.inference_mode():
            g.graph, g.logits = capture_graph(step, self._pool)
        return g

    def _capture_verify(self, b: int) -> _Graph:
        caches, t = self.lanes.caches[:b], self.draft_tokens + 1
        ids = torch.zeros(b * t, dtype=torch.long, device=self.device)
        positions = torch.zeros(b * t, dtype=torch.long, device=self.device)
        taps = self.drafter.taps() if self.drafter is not None else None
        rows = [Row(c, t, keep_inputs=True, all_logits=True) for c in caches]
        g = _Graph(None, ids, positions, None, taps, None, self._shifts(b * t))

        def step() -> torch.Tensor:
            with kept_lengths(caches):
                return self.model.forward_rows(ids, rows, positions, taps, g.rope())

        with torch.inference_mode():
            g.graph, g.logits = capture_graph(step, self._pool)
        g.kept = [c.kept for c in caches]
        return g

    def _pick(self, t: int, lane: int | None, cache: SequenceCache, keep_inputs: bool,
              taps: Taps | None) -> _Graph | None:
        if lane is None or in_media_prompt(cache):
            return None
        if t == 1 and not keep_inputs:
            g = self._graphs.get((lane, 1))
        elif keep_inputs:
            size = next((s for s in self.sizes if s >= t and s > 1), None)
            g = self._graphs.get((lane, size)) if size and cache.length + size <= cache.kv.table.span else None
        else:
            return None  # a short prefill chunk
        if g is None or (taps is None) != (g.taps is None):
            return None
        return g

    def forward(self, ids: torch.Tensor, cache: SequenceCache, all_logits: bool = False,
                taps: Taps | None = None, keep_inputs: bool = False,
                positions: torch.Tensor | None = None) -> torch.Tensor:
        t = ids.shape[0]
        g = self._pick(t, self.lanes.index(cache), cache, keep_inputs, taps) if positions is None else None
        if g is None:
            return self.model.forward(ids, cache, all_logits, taps, keep_inputs, positions)
        size, start = g.ids.shape[0], cache.length
        g.ids[:t].copy_(ids)  # padding positions keep earlier ids: any token is fine there
        torch.add(self._arange[:size], start, out=g.positions)
        if g.shifts is not None:  # a model that reads images
            g.shift([rope_delta(cache)] * size, self.device)
        g.graph.replay()
        self.replays += 1
        cache.length = start + t
        cache.kept = g.kept
        if taps is not None:
            first = g.taps.first(t)
            taps.layers, taps.hidden = first.layers, first.hidden
        # A copy, as batch steps return: the graphs share one memory pool, and another graph's replay may reuse
        # this one's static logits before they are read (the fallback of `forward_batch` replays several lanes
        # before it reads any; another thread's step may replay before the sampler reads). Without the copy,
        # concurrent sequences read each other's logits; it costs 1 MB per row.
        return (g.logits[:t] if size > 1 else g.logits).clone()

    def forward_rows(self, ids: torch.Tensor, rows: list[Row], taps: Taps | None = None) -> torch.Tensor:
        """A step over several sequences' rows (the model's `forward_rows`): plain decode rows replay a batch
        bucket's graph (the drafter's taps taken from it); decode and verify rows replay the bucket's batch verify
        graph where one covers their lanes, else each lane's own graphs one after another (the taps' rows joined
        in row order); a step with a prefill chunk among its rows runs eagerly, the rows as one batch."""
        if any(r.tokens > 1 and not r.keep_inputs for r in rows):
            return self.model.forward_rows(ids, rows, taps=taps)
        if not any(r.keep_inputs or r.all_logits for r in rows):
            return self.forward_batch(ids, [r.cache for r in rows], taps)
        if any(r.keep_inputs for r in rows) and (found := self._verify_graph(rows, taps)) is not None:
            return self._replay_verify(*found, ids, rows, taps)
        return self._lane_by_lane(ids, rows, taps)

    def _lane_by_lane(self, ids: torch.Tensor, rows: list[Row], taps: Taps | None) -> torch.Tensor:
        """Each row through its lane's own graphs (eagerly outside the lanes), one after another; the taps' rows
        joined in row order."""
        logits, parts, first = [], [], 0
        for r in rows:
            own = self.drafter.taps() if taps is not None else None
            logits.append(self.forward(ids[first:first + r.tokens], r.cache, r.all_logits, own, r.keep_inputs))
            if own is not None and len(rows) > 1:  # the graphs share one pool: the next lane's replay may reuse
                own.layers = {i: x.clone() for i, x in own.layers.items()}  # this one's static taps before the join
                own.hidden = own.hidden.clone() if own.hidden is not None else None
            parts.append(own)
            first += r.tokens
        if taps is not None:
            taps.layers = {i: torch.cat([p.layers[i] for p in parts]) for i in taps.layer_ids}
            taps.hidden = torch.cat([p.hidden for p in parts]) if taps.final else None
        return torch.cat(logits)

    def _verify_graph(self, rows: list[Row], taps: Taps | None) -> tuple[_Graph, list[int]] | None:
        """The batch verify graph that covers these decode and verify rows' lanes (and the lanes), if any: every
        row within K+1 tokens, its padded positions within its block table, the drafter's taps wanted as
        captured."""
        t = self.draft_tokens + 1
        lanes = [self.lanes.index(r.cache) for r in rows]
        if None in lanes or any(r.tokens > t or r.cache.length + t > r.cache.kv.table.span or in_media_prompt(r.cache)
                                for r in rows):
            return None
        b = batch_bucket(lanes, self.lanes.busy(), tuple(self._verifies))
        g = self._verifies.get(b) if b is not None else None
        return (g, lanes) if g is not None and (taps is None) == (g.taps is None) else None

    def _replay_verify(self, g: _Graph, lanes: list[int], ids: torch.Tensor, rows: list[Row],
                       taps: Taps | None) -> torch.Tensor:
        """Each row's tokens at its lane's place in the graph (the rest of a lane's K+1 places keep earlier ids:
        any token is fine there), then its logits (all of a verify row's, a decode row's last) and its taps'
        rows, joined in row order. A plain decode row ran as a verify row: its one token is committed here."""
        t = self.draft_tokens + 1
        b = len(g.kept)
        pairs = list(zip(rows, lanes, strict=True))
        places = [lane * t + j for r, lane in pairs for j in range(r.tokens)]
        positions = [c.length + j for c in self.lanes.caches[:b] for j in range(t)]
        wanted = [i for r, lane in pairs
                  for i in (range(lane * t, lane * t + r.tokens) if r.all_logits else [lane * t + r.tokens - 1])]
        # one host-to-device copy of the step's indices, sliced on the device: each copy costs a launch and a
        # staging buffer, and this runs every round
        index = to_device(places + positions + wanted, self.device)
        at_places, at_wanted = index[:len(places)], index[len(places) + len(positions):]
        g.ids.index_copy_(0, at_places, ids)
        g.positions.copy_(index[len(places):len(places) + len(positions)])
        if g.shifts is not None:  # a model that reads images
            g.shift([rope_delta(c) for c in self.lanes.caches[:b] for _ in range(t)], self.device)
        g.graph.replay()
        self.verify_replays += 1
        for r, lane in pairs:
            r.cache.length += r.tokens
            r.cache.kept = g.kept[lane]
            if not r.keep_inputs:
                r.cache.commit(1, 1)
        if taps is not None:
            taps.layers = {i: g.taps.layers[i].index_select(0, at_places) for i in taps.layer_ids}
            taps.hidden = g.taps.hidden.index_select(0, at_places) if taps.final else None
        return g.logits.index_select(0, at_wanted)

    def forward_batch(self, ids: torch.Tensor, caches: list[SequenceCache], taps: Taps | None = None) -> torch.Tensor:
        """One decode token for each of the caches (ids [B]), and their rows of the drafter's `taps` when given:
        a batch bucket's graph where one covers their lanes, else each lane's own decode graph in turn (eagerly
        for caches outside the lanes). Logits [B, vocab], a copy: the next replay overwrites the graph's own."""
        lanes = [self.lanes.index(c) for c in caches]
        if None in lanes or any(in_media_prompt(c) for c in caches):
            return self.model.forward_batch(ids, caches, taps=taps)
        b = batch_bucket(lanes, self.lanes.busy(), tuple(self._batches))
        g = self._batches[b] if b is not None else None
        if g is None or (taps is not None and g.taps is None):
            return self._lane_by_lane(ids, [Row(c, 1) for c in caches], taps)
        at = to_device(lanes, self.device)
        g.ids.index_copy_(0, at, ids)
        g.positions.copy_(to_device([c.length for c in self.lanes.caches[:b]], self.device))
        if g.shifts is not None:  # a model that reads images
            g.shift([rope_delta(c) for c in self.lanes.caches[:b]], self.device)
        g.graph.replay()
        self.batch_replays += 1
        for c in caches:
            c.length += 1
            c.kept = None
        if taps is not None:
            taps.layers = {i: g.taps.layers[i].index_select(0, at) for i in taps.layer_ids}
            taps.hidden = g.taps.hidden.index_select(0, at) if taps.final else None
        return g.logits.index_select(0, at)
