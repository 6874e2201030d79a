"""Rank 0 of an engine over several ranks (tensor parallelism): it runs the engine core as one process would, with
`ShardedModel` as its model. That model's steps send their plan to the other ranks (`worker.py`), which run the
same forward over their shards of the weights, KV and recurrent state; every cache operation that moves data
(a GDN state cleared, snapshot, restored or rolled back after a verify step, KV rows copied for a shared prefix or
to and from host memory with the host tier, a held conversation gathered for the disk tier or read back from it:
`disk.py`) is sent as it happens on rank 0, so the other ranks' caches follow. Block ids are rank 0's alone: its
pool hands them out, and a step carries each sequence's ids where they changed since its last step (the other
ranks' pools have the same blocks).

Drafters (MTP, DFlash) run on rank 0 alone, unsharded: they read the target's tapped hidden states, which are
whole on every rank (each tapped layer's output and the final norm's come after the all-reduces), and the whole
embedding and LM head, which rank 0 then loads whole (its vocabulary shard of each is a view of their first
rows). Their KV lives in rank 0's pool alone, under the same block ids as the target's. The vision tower runs on
rank 0 too: a prompt's images (their embeddings, places and M-RoPE positions) go to the other ranks once, with its
first step."""
from __future__ import annotations

import itertools
import threading
import weakref
from collections import deque
from dataclasses import dataclass, field

import torch
import torch.multiprocessing as mp

from ..cache.kv_cache import HostKV, KVCache
from ..cache.kv_pool import KVPool
from ..cache.sequence import SequenceCache
from ..cache.state_slots import GDNState, KeptInputs
from ..config import EngineConfig
from ..errors import NinferError, UserError
from ..media.prompt import PromptMedia
from ..models.decoder import BatchStep, Row
from ..models.spec import ModelSpec
from . import worker
from .comm import Comm, join, serve_store
from .layers import shard_model
from .shards import DRAFTER_MODELS, converted, cut_loaded, first_rows, shard_transform
from .support import check_tensor_parallel


class Channel:
    """Rank 0's orders to the other ranks, one pipe each, in the order it gives them. A state freed by the garbage
    collector (on any thread, maybe inside `send`) is queued and its order goes with the next batch."""

    def __init__(self, conns: list) -> None:
        self.conns = conns
        self.lock = threading.RLock()  # a step's order and its collectives go together
        self._keys = itertools.count(1)
        self._freed: deque[int] = deque()
        self._tables: dict[int, list[int]] = {}  # each sequence's block ids as the other ranks last got them
        self._media: dict[int, weakref.ref] = {}  # each sequence's images as the other ranks last got them

    def key(self) -> int:
        return next(self._keys)

    def free(self, key: int) -> None:
        self._freed.append(key)

    def send(self, *orders: tuple) -> None:
        with self.lock:
            freed = []
            while self._freed:
                freed.append(self._freed.popleft())
                self._tables.pop(freed[-1], None)
                self._media.pop(freed[-1], None)
            batch = ([("free", freed)] if freed else []) + list(orders)
            for rank, conn in enumerate(self.conns, start=1):
                try:
                    conn.send(batch)
                except OSError:
                    raise NinferError(f"tensor-parallel rank {rank} has exited", hint="its error is printed "
                                      "above; start the engine again") from None

    def media(self, key: int, media: PromptMedia | None) -> bool:
        """Whether a sequence's images (None: it has none now) are new to the other ranks, who get them now."""
        with self.lock:
            if media is None:
                self._media.pop(key, None)
                return False
            known = self._media.get(key)
            if known is not None and known() is media:
                return False
            self._media[key] = weakref.ref(media)
            return True

    def table(self, key: int, ids: list[int]) -> list[int] | None:
        """A sequence's block ids for its step: None where the other ranks have them already."""
        with self.lock:
            if self._tables.get(key) == ids:
                return None
            self._tables[key] = list(ids)
            return self._tables[key]


class SharedGDNState(GDNState):
    """Rank 0's heads of a sequence's GDN state; each operation on it is sent, for the other ranks to do on their
    heads of the state of the same key."""

    def __init__(self, local: GDNState, key: int, channel: Channel) -> None:
        super().__init__(local.conv, local.recurrent)
        self.key, self.channel = key, channel
        weakref.finalize(self, channel.free, key)

    def snapshot(self, host: bool = False) -> SharedGDNState:
        key = self.channel.key()
        self.channel.send(("snapshot", self.key, key, host))
        return SharedGDNState(super().snapshot(host), key, self.channel)

    def restore(self, other: SharedGDNState) -> None:
        self.channel.send(("restore", self.key, other.key))
        super().restore(other)

    def rollback(self, kept: KeptInputs, keep: int) -> None:
        self.channel.send(("rollback", self.key, keep))
        super().rollback(kept, keep)

    def clear(self) -> None:
        self.channel.send(("clear", self.key))
        super().clear()


class SharedHostKV(HostKV):
    """Rank 0's heads of a held conversation's KV in host memory (the host tier); the other ranks keep their
    heads' copies under `key` until this one goes."""

    def __init__(self, local: HostKV, key: int, channel: Channel) -> None:
        self.specs, self.rows, self.key = local.specs, local.rows, key
        weakref.finalize(self, channel.free, key)


@dataclass
class SharedSequenceCache(SequenceCache):
    """A sequence's cache on rank 0 (its `states` a SharedGDNState, whose key names the sequence to the other
    ranks). What moves its KV is sent too: held with the host tier (each rank copies its heads' rows to host
    memory), loaded from such a copy, or taking a shared held prefix (the KV rows past its full blocks copied)."""

    channel: Channel | None = field(default=None, repr=False)

    def detach(self, kv_to_host: bool = False, states_to_host: bool = False) -> SequenceCache:
        if not kv_to_host:
            return super().detach(kv_to_host, states_to_host)
        key = self.channel.key()
        # ordered before the blocks go back to the pool: no later step (that could write them) comes first
        self.channel.send(("to_host", key, list(self.kv.table.ids), self.length))
        held = super().detach(kv_to_host, states_to_host)
        held.kv = SharedHostKV(held.kv, key, self.channel)
        return held

    def load(self, other: SequenceCache, n: int, states=None, share: bool = False) -> None:
        super().load(other, n, states, share)
        if isinstance(other.kv, SharedHostKV):
            self.channel.send(("from_host", other.kv.key, list(self.kv.table.ids), n))
        elif share and isinstance(other.kv, KVCache):
            self.channel.send(("copy", list(other.kv.table.ids), list(self.kv.table.ids), n))


class ShardedModel(BatchStep):
    """What the engine core runs on rank 0: rank 0's shard of the model, each step's plan sent to the other ranks
    first (per row: its sequence, tokens, flags, cached length and changed block ids; the token ids go over the
    process group, on the device; the drafter's taps, for every rank to take the same collectives). Its
    `geometry` is the whole model's; its caches hold rank 0's heads. With `whole` (the embedding and LM head
    loaded whole) it is also the whole model a drafter reads: `embed`, `lm_head`, `mtp` and `attention`."""

    def __init__(self, local, geometry: ModelSpec, comm: Comm, channel: Channel,
                 whole: dict[str, torch.Tensor] | None = None) -> None:
        self.local, self.geometry, self.comm, self.channel = local, geometry, comm, channel
        self.device, self.dtype, self.kv_dtype = local.device, local.dtype, local.kv_dtype
        if whole:
            self.embed = whole["embed_tokens.weight"]
            self.lm_head = self.embed if geometry.tie_embeddings else whole["lm_head.weight"]
            self.mtp, self.rope, self.scale = local.mtp, local.rope, local.scale

    def attention(self, x, w, segments, slot: int, positions, cos, sin):
        """An attention layer over the whole model's heads, on rank 0 alone: the MTP drafter's (whole here)."""
        return type(self.local).attention(self, x, w, segments, slot, positions, cos, sin)

    def kv_spec(self):
        return self.local.kv_spec()

    def new_cache(self, max_len: int, pool: KVPool | None = None) -> SharedSequenceCache:
        cache = self.local.new_cache(max_len, pool)
        key = self.channel.key()
        self.channel.send(("new", key, max_len, pool is not None))
        return SharedSequenceCache(kv=cache.kv, states=SharedGDNState(cache.states, key, self.channel),
                                   channel=self.channel)

    def forward_rows(self, ids: torch.Tensor, rows: list[Row], positions: torch.Tensor | None = None,
                     taps=None, rope_positions: torch.Tensor | None = None) -> torch.Tensor:
        """`BatchStep.forward_rows` over the ranks. `rope_positions` come from CUDA graphs alone, which no rank
        captures: each rank turns its rows by their positions (a prompt's images: its M-RoPE ones)."""
        if rope_positions is not None:
            raise ValueError("tensor parallelism runs no CUDA graphs: its steps take no rope_positions")
        with self.channel.lock:
            plan = [(r.cache.states.key, r.tokens, r.keep_inputs, r.all_logits, r.cache.length,
                     self.channel.table(r.cache.states.key, r.cache.kv.table.ids), r.cache.media is not None)
                    for r in rows]
            # a prompt's images go once, before its first step: their places and positions with the order, their
            # embeddings (the tower ran here) over the process group
            fresh = [r for r in rows if self.channel.media(r.cache.states.key, r.cache.media)]
            orders = [_media_order(r.cache.states.key, r.cache.media) for r in fresh]
            tapped = None if taps is None else (taps.layer_ids, taps.final)
            self.channel.send(*orders, ("step", plan, ids.shape[0], ids.dtype, positions is not None, tapped))
            for r in fresh:
                self.comm.broadcast(r.cache.media.embeds.contiguous())
            self.comm.broadcast(ids)
            if positions is not None:
                self.comm.broadcast(positions)
            return self.local.forward_rows(ids, rows, positions, taps)


def _media_order(key: int, media: PromptMedia) -> tuple:
    """A sequence's images for the other ranks: their rows and M-RoPE positions (their embeddings follow over the
    process group)."""
    return ("media", key, media.positions.tolist(), media.delta, media.rows.tolist(), tuple(media.embeds.shape),
            media.embeds.dtype)


class Leader:
    """The other ranks of an engine, from rank 0: their processes (spawned, one per GPU), the process group and
    the channel. `transform` cuts rank 0's weights as they load; `model` builds its ShardedModel once every rank
    has loaded its shard. `close` (or the leader's collection) stops the other ranks."""

    def __init__(self, config: EngineConfig, geometry: ModelSpec, dtype: torch.dtype, device: torch.device) -> None:
        check_tensor_parallel(config, geometry, device)
        self.geometry, self.world = geometry, config.tensor_parallel
        self.store = serve_store(self.world)
        ctx = mp.get_context("spawn")
        self.procs, conns = [], []
        for rank in range(1, self.world):
            ours, theirs = ctx.Pipe()
            proc = ctx.Process(target=worker.main, name=f"ninfer-rank-{rank}", daemon=True,
                               args=(rank, config, geometry, dtype, device.type, self.store.port, theirs))
            proc.start()
            theirs.close()
            self.procs.append(proc)
            conns.append(ours)
        self._stop = weakref.finalize(self, _stop, self.procs, conns)
        self.conns = conns
        self._expect("started", "starting")  # each says so right before it joins: none died on the way
        self.comm = join(self.store.port, 0, self.world, device, self.store)
        self.channel = Channel(conns)
        self.whole_vocab = config.spec in DRAFTER_MODELS
        self.converted = converted(config.model)

    def transform(self, then=None):
        """Rank 0's per-weight loading hook: its piece of each weight (the embedding and LM head whole where a
        drafter reads them), then `then` (quantizing)."""
        return shard_transform(self.geometry, 0, self.world, then, self.whole_vocab)

    def model(self, geometry: ModelSpec, weights: dict, kv_dtype: str) -> ShardedModel:
        """Rank 0's model over its loaded pieces (a converted folder's weights, loaded whole, cut here), once every
        other rank has loaded its own."""
        if self.converted:
            weights.update(cut_loaded(weights, geometry, 0, self.world, self.whole_vocab))
        self._expect("ready", "loading its shard")
        whole = {}
        if self.whole_vocab:  # rank 0's rows of the vocabulary are the first ones: its shard is a view of them
            for name in ("embed_tokens.weight", "lm_head.weight"):
                if name in weights:
                    whole[name] = weights[name]
                    weights[name] = first_rows(whole[name], geometry.vocab_size // self.world)
        return ShardedModel(shard_model(geometry, weights, kv_dtype, self.comm), geometry, self.comm, self.channel,
                            whole)

    def open_disk_tier(self, folder: str, mib: int, model_name: str, model: ShardedModel, weights: dict[str, str],
                       pool: KVPool):
        """`cache.disk_tier.open_disk_tier` over the ranks: rank 0's tier of the whole model's files."""
        from .disk import open_parallel_disk_tier

        return open_parallel_disk_tier(folder, mib, model_name, model, weights, pool)

    def close(self) -> None:
        self._stop()

    def _expect(self, word: str, doing: str) -> None:
        """Wait for every other rank's `word`; a rank that failed (its error) or died raises here."""
        for rank, (proc, conn) in enumerate(zip(self.procs, self.conns, strict=True), start=1):
            message = _receive(proc, conn)
            if message is None:
                self.close()
                raise NinferError(f"tensor-parallel rank {rank} exited (code {proc.exitcode}) while {doing}",
                                  hint="its error is printed above")
            if message[0] == "failed":
                self.close()
                _, text, hint, user = message
                raise (UserError if user else NinferError)(f"tensor-parallel rank {rank}: {text}", hint=hint)
            if message[0] != word:
                self.close()
                raise NinferError(f"tensor-parallel rank {rank} answered {message[0]!r} while {doing}, not {word!r}")


def _receive(proc, conn) -> tuple | None:
    """A rank's next message, or None when its process ended first."""
    while not conn.poll(0.2):
        if not proc.is_alive():
            return None
    try:
        return conn.recv()
    except EOFError:  # it closed its end as it exited
        proc.join(timeout=5)
        return None


def _stop(procs: list, conns: list) -> None:
    """Tell the other ranks to stop and wait for them; one stuck in a collective (its peer gone) is terminated."""
    for conn in conns:
        try:
            conn.send([("stop",)])
        except OSError:  # it is gone already
            pass
        conn.close()
    for proc in procs:
        proc.join(timeout=10)
        if proc.is_alive():
            proc.terminate()
            proc.join()
