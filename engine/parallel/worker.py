"""A rank other than 0 (tensor parallelism): a process rank 0 spawned, holding its shard of the weights, of the KV
pool (its KV heads) and of every sequence's GDN state (its heads). It does what rank 0's orders say (`leader.py`),
in their order: make a sequence's cache, take a prompt's images (their embeddings, the tower being rank 0's), run a
step over its caches (the same forward, its collectives meeting rank 0's), clear, snapshot, restore or roll back a
GDN state, copy KV rows (or to and from host memory, the host tier), send its heads of a conversation going to
disk and take those of one read back, free what rank 0 let go."""
from __future__ import annotations

import sys
import traceback

import torch

from ..cache.kv_cache import HostKV, copy_tokens
from ..cache.kv_pool import PAGE, SCRATCH, BlockTable, KVPool
from ..cache.sequence import SequenceCache
from ..cache.state_slots import GDNState
from ..config import EngineConfig
from ..errors import NinferError
from ..kernels import cpu_build
from ..loaders import load_model
from ..media.prompt import PromptMedia
from ..models.decoder import Row
from ..models.spec import ModelSpec
from ..models.taps import Taps
from ..quant.qweight import load_transform
from .comm import Comm, join
from .layers import shard_model
from .shards import converted, cut_loaded, shard_transform


def main(rank: int, config: EngineConfig, geometry: ModelSpec, dtype: torch.dtype, device_type: str, port: int,
         conn) -> None:
    """The process: join the group, load this rank's shard, then serve rank 0's orders until it says stop (or
    its end of the pipe closes). A failure while loading goes to rank 0, which reports it."""
    if config.threads:
        torch.set_num_threads(config.threads)
    cpu_build.use_dir(config.cpu_kernels_dir)
    device = torch.device("cuda", rank) if device_type == "cuda" else torch.device("cpu")
    conn.send(("started",))
    comm = join(port, rank, config.tensor_parallel, device)
    try:
        model, pool = _load(rank, config, geometry, dtype, device, comm)
    except BaseException as exc:  # reported by rank 0, whose process says what failed
        user = isinstance(exc, NinferError)
        conn.send(("failed", str(exc) if user else f"{type(exc).__name__}: {exc}",
                   exc.hint if user else None, user))
        return
    conn.send(("ready",))
    try:
        Worker(model, pool, comm).serve(conn)
    except BaseException:
        traceback.print_exc(file=sys.stderr)  # the others' next collective fails on the closed connection
        sys.exit(1)


def _load(rank: int, config: EngineConfig, geometry: ModelSpec, dtype: torch.dtype, device: torch.device,
          comm: Comm):
    """This rank's model and KV pool, as rank 0's engine makes its own (the same blocks)."""
    if device.type == "cuda":
        from ..engine import available_bytes
        from ..memory_plan import check_fit, plan_memory

        verdict = check_fit(plan_memory(geometry, config, "cuda"), available_bytes(device))
        if not verdict.fits:
            raise NinferError(f"the model's shard and its settings do not fit on {device}: {verdict.message()}",
                              hint=verdict.advice)
    then = load_transform(config.weights, config.tiled_weights)
    loaded = load_model(config.model, dtype, device, shard_transform(geometry, rank, config.tensor_parallel, then),
                        vision=False, tiled=config.tiled_weights, verified_shards=config.verified_shards)
    weights = {k: v for k, v in loaded.weights.items() if not k.startswith("mtp.")}
    if converted(config.model):  # loaded whole, in their stored formats
        weights = cut_loaded(weights, geometry, rank, config.tensor_parallel)
    model = shard_model(geometry, weights, config.kv_dtype, comm)
    pool = KVPool.for_tokens(config.kv_tokens, device)
    pool.store("target", model.kv_spec())
    return model, pool


def mirror(table: BlockTable, ids: list[int]) -> None:
    """Point a table at rank 0's block ids for the sequence (the pool's free list is rank 0's business)."""
    table.ids = []
    table.tensor.fill_(SCRATCH)
    table.add(list(ids))


class Worker:
    """Rank 0's orders over this rank's caches: `caches` by sequence key, `states` by key (every sequence's, and
    the snapshots rank 0 keeps of them)."""

    def __init__(self, model, pool: KVPool, comm: Comm) -> None:
        self.model, self.pool, self.comm = model, pool, comm
        self.caches: dict[int, SequenceCache] = {}
        self.states: dict[int, GDNState] = {}
        self.hosts: dict[int, HostKV] = {}  # host-tier copies of held sequences' KV

    def serve(self, conn) -> None:
        while True:
            try:
                batch = conn.recv()
            except EOFError:  # rank 0 is gone
                return
            for op, *args in batch:
                if op == "stop":
                    return
                with torch.no_grad():
                    getattr(self, "_" + op)(*args)

    def _new(self, key: int, max_len: int, pooled: bool) -> None:
        cache = self.model.new_cache(max_len, self.pool if pooled else None)
        self.caches[key], self.states[key] = cache, cache.states

    def _step(self, plan: list[tuple], count: int, dtype: torch.dtype, with_positions: bool,
              tapped: tuple[tuple[int, ...], bool] | None) -> None:
        device = self.model.device
        rows = []
        for key, tokens, keep_inputs, all_logits, length, table, media in plan:
            cache = self.caches[key]
            cache.length = length
            if table is not None:
                mirror(cache.kv.table, table)
            if not media:
                cache.media = None
            rows.append(Row(cache, tokens, keep_inputs, all_logits))
        with torch.inference_mode():
            ids = self.comm.broadcast(torch.empty(count, dtype=dtype, device=device))
            positions = self.comm.broadcast(torch.empty(count, dtype=torch.long, device=device)) \
                if with_positions else None
            # the taps rank 0's drafter asked for: a tapped step may take other paths (and collectives)
            self.model.forward_rows(ids, rows, positions, Taps(*tapped) if tapped is not None else None)

    def _media(self, key: int, positions: list, delta: int, rows: list[int], shape: tuple[int, ...],
               dtype: torch.dtype) -> None:
        """A sequence's images, for its steps: their rows' M-RoPE positions and the tower's embeddings."""
        embeds = self.comm.broadcast(torch.empty(shape, dtype=dtype, device=self.model.device))
        self.caches[key].media = PromptMedia(torch.tensor(positions), delta, torch.tensor(rows, dtype=torch.long),
                                             embeds, [])

    def _clear(self, key: int) -> None:
        self.states[key].clear()

    def _snapshot(self, key: int, new: int, host: bool) -> None:
        self.states[new] = self.states[key].snapshot(host)

    def _restore(self, key: int, source: int) -> None:
        self.states[key].restore(self.states[source])

    def _rollback(self, key: int, keep: int) -> None:
        cache = self.caches[key]
        cache.states.rollback(cache.kept, keep)
        cache.kept = None

    def _copy(self, source: list[int], target: list[int], n: int) -> None:
        """KV rows of a shared prefix past its full blocks, from the held sequence's blocks into the taker's."""
        copy_tokens(self._blocks(source), self._blocks(target), n // PAGE * PAGE, n)

    def _to_host(self, key: int, ids: list[int], n: int) -> None:
        """A sequence held with the host tier: its first n tokens' KV (this rank's heads) out of its blocks."""
        self.hosts[key] = HostKV(self._blocks(ids), n)

    def _from_host(self, key: int, ids: list[int], n: int) -> None:
        """A host-tier copy's first n tokens into the blocks of the sequence that takes them."""
        self.hosts[key].copy_to(self._blocks(ids), n)

    def _gather(self, host: int | None, ids: list[int], n: int, names: list[str], keys: list[int]) -> None:
        """A held conversation going to disk (its KV in the host tier under `host`, or in blocks `ids`): this
        rank's heads of its KV rows and of its states `keys`, gathered on rank 0 (`disk.py`)."""
        device = self.model.device
        rows = (self.hosts[host] if host is not None else HostKV(self._blocks(ids), n)).rows["target"]
        for name in names:
            self.comm.gather(rows[name].to(device))
        for key in keys:
            self.comm.gather(self.states[key].conv.to(device))
            self.comm.gather(self.states[key].recurrent.to(device))

    def _scatter(self, key: int, shapes: dict[str, tuple], keys: list[int], conv: tuple, recurrent: tuple) -> None:
        """A held conversation read from disk: this rank's heads of its KV rows (kept as the host tier keeps them,
        under `key`) and of its states (under `keys`), in host memory."""
        def take(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
            out = torch.empty(shape, dtype=dtype, device=self.model.device)
            return self.comm.scatter(None, out).cpu()

        rows = {name: take(*shape) for name, shape in shapes.items()}
        self.hosts[key] = HostKV.from_rows({"target": self.pool.stores["target"].spec}, {"target": rows})
        for k in keys:
            self.states[k] = GDNState(take(*conv), take(*recurrent))

    def _blocks(self, ids: list[int]) -> BlockTable:
        table = BlockTable(self.pool, len(ids) * PAGE)
        table.add(ids)
        return table

    def _free(self, keys: list[int]) -> None:
        for key in keys:
            self.caches.pop(key, None)
            self.states.pop(key, None)
            self.hosts.pop(key, None)
