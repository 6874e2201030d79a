"""One sequence's attention KV: its rows of a paged pool's store (bf16, or int8 / fp8 (e4m3) with
per-(token, head) scales), found through its block table; and `HostKV`, a held conversation's KV copied to host
memory (the host tier)."""
from __future__ import annotations

import torch

from ..kernels import kvwrite
from .kv_pool import PAGE, BlockTable, KVPool, KVStore, StoreSpec

# Largest magnitude each 8-bit format stores; a per-(token, head) scale maps the head's absmax onto it.
_QMAX = {"int8": 127.0, "fp8": 448.0}


class KVCache:
    def __init__(self, store: KVStore, table: BlockTable) -> None:
        self.store, self.table = store, table

    @classmethod
    def new(cls, spec: StoreSpec, max_tokens: int, device: torch.device, pool: KVPool | None = None,
            key: str = "target") -> KVCache:
        """A sequence of up to `max_tokens` tokens in store `key` of `pool`, holding no blocks yet; without a
        pool, in a pool of its own with all the blocks it needs."""
        own = pool is None
        if own:
            pool = KVPool.for_tokens(max_tokens, device)
        kv = cls(pool.store(key, spec), BlockTable(pool, max_tokens))
        if own:
            kv.table.reserve(max_tokens)
        return kv

    def view(self, key: str, spec: StoreSpec) -> KVCache:
        """The same sequence's KV in another store of its pool (a drafter's, indexed by the same blocks)."""
        return KVCache(self.table.pool.store(key, spec), self.table)

    @property
    def capacity(self) -> int:
        return self.table.capacity

    @property
    def nbytes(self) -> int:
        """What the sequence's blocks take in every store of the pool."""
        return len(self.table.ids) * self.table.pool.bytes_per_block

    def write(self, layer: int, positions: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store k, v [T, H, D] at `positions` (a device tensor: a captured CUDA graph replays this at whatever
        positions the buffer holds then)."""
        s, kv_dtype = self.store, self.store.spec.kv_dtype
        if kvwrite.usable(k, kv_dtype):
            kvwrite.write(k, v, positions, self.table.tensor, s.k[layer], s.v[layer], *s.scales(layer), kv_dtype)
            return
        if not s.quantized and positions.device.type == "cpu" and positions.numel() == 1:
            # one CPU decode token: its row found in Python (`BlockTable.slots`' arithmetic), not by four tensor ops
            p = int(positions)
            if p // PAGE < len(self.table.ids):
                row = self.table.ids[p // PAGE] * PAGE + p % PAGE
                s.k[layer][row].copy_(k.reshape(k.shape[-2:]))
                s.v[layer][row].copy_(v.reshape(v.shape[-2:]))
                return
        slots = self.table.slots(positions)
        if not s.quantized:
            s.k[layer].index_copy_(0, slots, k.to(s.k.dtype))
            s.v[layer].index_copy_(0, slots, v.to(s.v.dtype))
            return
        for src, dst, scale in ((k, s.k, s.k_scale), (v, s.v, s.v_scale)):
            q, sc = quantize_per_head(src, kv_dtype)
            _bytes(dst[layer]).index_copy_(0, slots, _bytes(q))
            scale[layer].index_copy_(0, slots, sc)

    def read(self, layer: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        s, dtype = self.store, self.store.spec.compute_dtype
        at = _where(self.table, end, s.k.device)
        if not s.quantized:
            return _take(s.k[layer], at).to(dtype), _take(s.v[layer], at).to(dtype)
        return (dequantize_per_head(_take(s.k[layer], at), _take(s.k_scale[layer], at), dtype),
                dequantize_per_head(_take(s.v[layer], at), _take(s.v_scale[layer], at), dtype))


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """fp8 codes as bytes: torch's CPU gathers and scatters have no fp8 kernels."""
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t


def _where(table: BlockTable, end: int, device: torch.device) -> slice | torch.Tensor:
    """Where tokens 0..end-1 lie in a store: a slice of rows when their blocks are consecutive, else the rows."""
    first = table.run(end)
    if first is not None:
        return slice(first, first + end)
    return table.slots(torch.arange(end, device=device))


def _take(t: torch.Tensor, at: slice | torch.Tensor) -> torch.Tensor:
    """One layer's rows at `_where`'s answer: a view of a slice, or a gather."""
    return t[at] if isinstance(at, slice) else _bytes(t).index_select(0, at).view(t.dtype)


def copy_tokens(src: BlockTable, dst: BlockTable, start: int, end: int) -> None:
    """Tokens start..end-1 of one sequence into another's blocks, in every store of their (one) pool."""
    if end <= start:
        return
    pos = torch.arange(start, end, device=src.pool.device)
    src_rows, dst_rows = src.slots(pos), dst.slots(pos)
    for store in src.pool.stores.values():
        for name in store.names():
            t = _bytes(getattr(store, name))
            t.index_copy_(1, dst_rows, t.index_select(1, src_rows))


class HostKV:
    """The first n tokens of a sequence's KV in every store of its pool, copied to host memory (pinned, queued
    behind the device's work, one layer at a time so the device needs no copy of the whole): what a held
    conversation keeps with the host tier on."""

    def __init__(self, table: BlockTable, n: int) -> None:
        self.specs = {key: store.spec for key, store in table.pool.stores.items()}
        self.rows: dict[str, dict[str, torch.Tensor]] = {}
        at = _where(table, n, table.pool.device)
        for key, store in table.pool.stores.items():
            self.rows[key] = {}
            for name in store.names():
                src = getattr(store, name)
                host = torch.empty((src.shape[0], n, *src.shape[2:]), dtype=src.dtype, pin_memory=src.is_cuda)
                for layer in range(src.shape[0]):
                    host[layer].copy_(_take(src[layer], at), non_blocking=True)
                self.rows[key][name] = host

    @classmethod
    def from_rows(cls, specs: dict[str, StoreSpec], rows: dict[str, dict[str, torch.Tensor]]) -> HostKV:
        """KV already in host memory (the disk tier's file): rows [layers, n, ...] of each store's tensors."""
        kv = cls.__new__(cls)
        kv.specs, kv.rows = specs, rows
        return kv

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for rows in self.rows.values() for t in rows.values())

    def copy_to(self, table: BlockTable, n: int) -> None:
        """Into the first n tokens of `table`'s sequence, whose blocks hold them."""
        device = table.pool.device
        slots = table.slots(torch.arange(n, device=device))
        for key, rows in self.rows.items():
            store = table.pool.store(key, self.specs[key])
            for name, host in rows.items():
                dst = getattr(store, name)
                for layer in range(dst.shape[0]):
                    _bytes(dst[layer]).index_copy_(0, slots, _bytes(host[layer, :n]).to(device, non_blocking=True))


def quantize_per_head(x: torch.Tensor, kv_dtype: str) -> tuple[torch.Tensor, torch.Tensor]:
    """x: [T, H, D] -> (codes [T, H, D], scale [T, H]) with x ~= codes * scale."""
    xf = x.float()
    scale = xf.abs().amax(dim=-1).clamp_min(1e-12) / _QMAX[kv_dtype]
    scaled = xf / scale[..., None]
    if kv_dtype == "int8":  # halves round up (not to even): the fused write kernel rounds the same way
        return torch.floor(scaled + 0.5).clamp_(-127, 127).to(torch.int8), scale
    return scaled.to(torch.float8_e4m3fn), scale


def dequantize_per_head(codes: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return (codes.float() * scale[..., None]).to(dtype)
