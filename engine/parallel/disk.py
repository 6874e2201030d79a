"""The disk tier of held conversations over several ranks: rank 0's tier writes and reads the files a one-process
engine does (`cache/disk_tier.py`), of the same identity (the model, its formats, the whole model's KV heads and
recurrent state), so each engine continues the other's conversations. A conversation going to disk is gathered on
rank 0 first: every rank's heads of its KV rows and recurrent states, joined in rank order. One read back is cut
again on the reader thread, each rank keeping its heads in host memory as the host tier does (`SharedHostKV`, the
states as snapshots) until a request takes them."""
from __future__ import annotations

import logging
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import torch

from ..cache.disk_tier import DiskEntry, DiskTier, Loaded, identity
from ..cache.kv_cache import HostKV
from ..cache.kv_pool import KVPool
from ..cache.sequence import SequenceCache
from ..cache.state_slots import GDNState
from .leader import ShardedModel, SharedGDNState, SharedHostKV
from .shards import cut, gdn_channels, join

log = logging.getLogger("ninfer.engine")

# Where the ranks' pieces lie: the target's KV rows [layers, tokens, heads, dim] (scales [layers, tokens, heads])
# by heads; the GDN conv state [layers, K-1, channels] by the blocks of its channels; the recurrent state
# [layers, heads, dk, dv] by heads. A drafter's KV stores are rank 0's alone, whole.
KV_HEADS, CONV_CHANNELS, RECURRENT_HEADS = 2, 2, 1


def open_parallel_disk_tier(folder: str, mib: int, model_name: str, model: ShardedModel, weights: dict[str, str],
                            pool: KVPool) -> ParallelDiskTier | None:
    """`cache.disk_tier.open_disk_tier` for rank 0 of several."""
    if not folder or mib <= 0:
        return None
    try:
        return ParallelDiskTier(Path(folder), mib << 20, model_name, model, weights, pool)
    except OSError as exc:
        log.warning("the disk tier of held conversations is off: %s", exc)
        return None


class ParallelDiskTier(DiskTier):
    def __init__(self, folder: Path, cap_bytes: int, model_name: str, model: ShardedModel, weights: dict[str, str],
                 pool: KVPool) -> None:
        self.model, self.channel, self.comm = model, model.channel, model.comm
        self.local_specs = {key: store.spec for key, store in pool.stores.items()}
        # the whole model's stores and recurrent state, as a one-process engine's pool and model describe them
        whole = SimpleNamespace(stores={key: SimpleNamespace(spec=replace(spec, heads=spec.heads * self.comm.world)
                                                             if key == "target" else spec)
                                        for key, spec in self.local_specs.items()})
        described = SimpleNamespace(linear_index=model.local.linear_index, geometry=model.geometry,
                                    conv_dim=sum(gdn_channels(model.geometry)), dtype=model.dtype)
        super().__init__(folder, cap_bytes, identity(model_name, described, weights, whole), whole)

    def spill(self, tokens: list[int], cache, checkpoints: dict[int, GDNState], wait: bool = False) -> None:
        """`DiskTier.spill` of the whole conversation, gathered from every rank."""
        whole, kept = self._gather(cache, checkpoints)
        super().spill(tokens, whole, kept, wait)

    def load(self, entry: DiskEntry) -> Loaded | None:
        """`DiskTier.load`, then each rank's heads of it sent to it."""
        loaded = super().load(entry)
        if loaded is None:
            return None
        tokens, kv, states, checkpoints = loaded
        kv, shared = self._scatter(kv, [states, *checkpoints.values()])
        return tokens, kv, shared[0], dict(zip(checkpoints, shared[1:], strict=True))

    def _gather(self, cache: SequenceCache, checkpoints: dict[int, GDNState]
                ) -> tuple[SequenceCache, dict[int, GDNState]]:
        """A held conversation (its KV in rank 0's blocks or host tier, its state and checkpoints snapshots that
        every rank keeps its heads of) as the whole model's, in host memory."""
        n, device, channels = cache.length, self.model.device, gdn_channels(self.model.geometry)
        states = [cache.states, *checkpoints.values()]
        with self.channel.lock:
            if isinstance(cache.kv, SharedHostKV):
                mine, host, ids = cache.kv, cache.kv.key, []
            else:
                mine, host, ids = HostKV(cache.kv.table, n), None, list(cache.kv.table.ids)
            names = list(mine.rows["target"])
            self.channel.send(("gather", host, ids, n, names, [s.key for s in states]))
            rows = dict(mine.rows)
            rows["target"] = {name: self._joined(mine.rows["target"][name].to(device), KV_HEADS) for name in names}
            joined = [GDNState(self._joined(s.conv.to(device), CONV_CHANNELS, channels),
                               self._joined(s.recurrent.to(device), RECURRENT_HEADS)) for s in states]
        whole = SequenceCache(kv=HostKV.from_rows(self._specs, rows), states=joined[0], length=n)
        return whole, dict(zip(checkpoints, joined[1:], strict=True))

    def _joined(self, piece: torch.Tensor, dim: int, sizes: tuple[int, ...] | None = None) -> torch.Tensor:
        return join([p.cpu() for p in self.comm.gather(piece)], dim, sizes)

    def _scatter(self, kv: HostKV, states: list[GDNState]) -> tuple[SharedHostKV, list[SharedGDNState]]:
        """A conversation read whole: rank 0's heads of its KV and states, the other ranks' sent to them, each
        rank's kept under the same keys."""
        world, channels = self.comm.world, gdn_channels(self.model.geometry)
        target = kv.rows["target"]
        pieces = {name: [cut(t, KV_HEADS, r, world) for r in range(world)] for name, t in target.items()}
        parts = [([cut(s.conv, CONV_CHANNELS, r, world, channels) for r in range(world)],
                  [cut(s.recurrent, RECURRENT_HEADS, r, world) for r in range(world)]) for s in states]
        with self.channel.lock:
            key, keys = self.channel.key(), [self.channel.key() for _ in states]
            shapes = {name: _shape(p[0]) for name, p in pieces.items()}
            self.channel.send(("scatter", key, shapes, keys, _shape(parts[0][0][0]), _shape(parts[0][1][0])))
            rows = dict(kv.rows)
            rows["target"] = {name: self._sent(p) for name, p in pieces.items()}
            mine = [GDNState(self._sent(conv), self._sent(recurrent)) for conv, recurrent in parts]
        return (SharedHostKV(HostKV.from_rows(self.local_specs, rows), key, self.channel),
                [SharedGDNState(s, k, self.channel) for s, k in zip(mine, keys, strict=True)])

    def _sent(self, pieces: list[torch.Tensor]) -> torch.Tensor:
        """Each rank's piece sent to it; rank 0's own back, in host memory."""
        device = self.model.device
        return self.comm.scatter([p.to(device) for p in pieces], torch.empty_like(pieces[0], device=device)).cpu()


def _shape(t: torch.Tensor) -> tuple[tuple[int, ...], torch.dtype]:
    return tuple(t.shape), t.dtype
