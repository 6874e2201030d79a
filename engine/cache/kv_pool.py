"""The paged KV pool: attention KV in blocks of PAGE tokens that sequences take and give back.

A sequence's blocks are listed in its `BlockTable`; kernels find token p of a sequence at row
table[p // PAGE] * PAGE + p % PAGE of a store. One pool serves every running sequence and every held
conversation (their blocks stay where they are until the next turn takes them, or until a running request needs
the room), so a conversation costs the pool what it holds, not `max_context`. A pool has several stores when a
drafter keeps KV per token of the target's sequence (DFlash's context K/V, MTP's layer): a sequence's block ids
index all of them, so the drafter's KV needs no allocation of its own.

Block 0 is scratch, never handed out: table entries past a sequence's blocks point at it, so what a captured
graph writes past a sequence's end (a verify step's padding, a free lane's throw-away token) lands there and no
sequence reads it.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass

import torch

PAGE = 64  # tokens per block: a multiple of the attention kernel's key tile
SCRATCH = 0
_STORE = {"bf16": torch.bfloat16, "int8": torch.int8, "fp8": torch.float8_e4m3fn}


def pages(tokens: int) -> int:
    return -(-tokens // PAGE)


def pool_rows(tokens: int) -> int:
    """Token rows a pool of `tokens` tokens allocates in each store: whole blocks, and the scratch block."""
    return (pages(tokens) + 1) * PAGE


@dataclass(frozen=True)
class StoreSpec:
    """The attention layers one store holds the KV of."""

    layers: int
    heads: int
    dim: int
    kv_dtype: str  # "auto" (the compute dtype), "bf16", "int8" or "fp8"
    compute_dtype: torch.dtype


class KVStore:
    """Every block's rows for some attention layers: codes k, v [layers, rows, H, D], and for 8-bit formats a
    scale per (row, head) k_scale, v_scale [layers, rows, H]."""

    def __init__(self, spec: StoreSpec, rows: int, device: torch.device) -> None:
        self.spec = spec
        self.quantized = spec.kv_dtype in ("int8", "fp8")
        store = spec.compute_dtype if spec.kv_dtype == "auto" else _STORE[spec.kv_dtype]
        shape = (spec.layers, rows, spec.heads, spec.dim)
        self.k = torch.empty(shape, dtype=store, device=device)
        self.v = torch.empty(shape, dtype=store, device=device)
        if self.quantized:
            self.k_scale = torch.empty(shape[:3], dtype=torch.float32, device=device)
            self.v_scale = torch.empty(shape[:3], dtype=torch.float32, device=device)

    def names(self) -> tuple[str, ...]:
        return ("k", "v", "k_scale", "v_scale") if self.quantized else ("k", "v")

    def scales(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """A layer's k and v scales, the kernels' scale arguments (unread stand-ins when the store keeps none)."""
        return (self.k_scale[layer], self.v_scale[layer]) if self.quantized else (self.k[layer], self.v[layer])

    @property
    def bytes_per_row(self) -> int:
        return sum(getattr(self, n)[:, 0].nbytes for n in self.names())


class KVPool:
    """`blocks` blocks of PAGE tokens (plus the scratch block) and the stores that hold their rows. A block may be
    in several sequences' tables (a shared prefix: its full blocks, which no sharer writes); it is free again when
    the last one gives it back."""

    def __init__(self, blocks: int, device: torch.device) -> None:
        self.blocks, self.device = blocks + 1, device
        self._free = list(range(blocks, SCRATCH, -1))  # pop() hands out low ids first: runs stay consecutive
        self._refs = [0] * self.blocks
        self._lock = threading.Lock()
        self.stores: dict[str, KVStore] = {}

    @classmethod
    def for_tokens(cls, tokens: int, device: torch.device) -> KVPool:
        return cls(pages(tokens), device)

    def store(self, key: str, spec: StoreSpec) -> KVStore:
        """The store `key` (created on first use, for every block)."""
        store = self.stores.get(key)
        if store is None:
            store = self.stores[key] = KVStore(spec, self.blocks * PAGE, self.device)
        elif store.spec != spec:
            raise ValueError(f"KV store {key!r} exists with {store.spec}, asked for {spec}")
        return store

    @property
    def free_blocks(self) -> int:
        with self._lock:
            return len(self._free)

    @property
    def bytes_per_block(self) -> int:
        return PAGE * sum(s.bytes_per_row for s in self.stores.values())

    def allocate(self, n: int) -> list[int] | None:
        """n free blocks, or None (and none taken) when fewer are free."""
        with self._lock:
            if n > len(self._free):
                return None
            ids = [self._free.pop() for _ in range(n)]
            for i in ids:
                self._refs[i] = 1
            return ids

    def retain(self, ids: list[int]) -> None:
        """One more table lists these blocks."""
        with self._lock:
            for i in ids:
                self._refs[i] += 1

    def release(self, ids: list[int]) -> None:
        with self._lock:
            freed = []
            for i in ids:
                self._refs[i] -= 1
                if not self._refs[i]:
                    freed.append(i)
            self._free.extend(sorted(freed, reverse=True))

    def freeable(self, tables: list[list[int]]) -> int:
        """Blocks that would be free if these block lists were given back (those no other table lists)."""
        counts: dict[int, int] = {}
        for ids in tables:
            for i in ids:
                counts[i] = counts.get(i, 0) + 1
        with self._lock:
            return sum(1 for i, c in counts.items() if self._refs[i] == c)


class BlockTable:
    """One sequence's blocks in a pool: `ids` on the host and `tensor` [pages] (int32) on the pool's device, which
    kernels and captured graphs read; entries past the ids hold the scratch block. `pages` covers the longest
    sequence the table serves plus one page, room for a graph step's padding past its end."""

    def __init__(self, pool: KVPool, max_tokens: int) -> None:
        self.pool = pool
        self.ids: list[int] = []
        self._consecutive = 0  # how many of the ids, from the first, are consecutive
        self.tensor = torch.full((pages(max_tokens) + 1,), SCRATCH, dtype=torch.int32, device=pool.device)

    @property
    def capacity(self) -> int:
        """Tokens the sequence's blocks hold."""
        return len(self.ids) * PAGE

    @property
    def span(self) -> int:
        """Positions the table maps (to the sequence's blocks or to scratch)."""
        return self.tensor.shape[0] * PAGE

    def add(self, ids: list[int], front: bool = False) -> None:
        """Blocks (taken from the pool by the caller) as the sequence's last ones, or its first ones."""
        if len(self.ids) + len(ids) > self.tensor.shape[0] - 1:
            raise ValueError(f"{len(self.ids) + len(ids)} blocks exceed the table's {self.tensor.shape[0] - 1}")
        if not ids:
            return
        start = 0 if front else len(self.ids)
        self.ids = ids + self.ids if front else self.ids + ids
        n = 1
        while n < len(self.ids) and self.ids[n] == self.ids[n - 1] + 1:
            n += 1
        self._consecutive = n
        self._write(start)

    def reserve(self, tokens: int) -> bool:
        """Blocks from the pool until the sequence holds `tokens` tokens; False (nothing taken) when the pool
        lacks them."""
        more = pages(tokens) - len(self.ids)
        if more <= 0:
            return True
        ids = self.pool.allocate(more)
        if ids is None:
            return False
        self.add(ids)
        return True

    def truncate(self, tokens: int) -> None:
        """Give back the blocks past the first `tokens` tokens."""
        keep = pages(tokens)
        if keep < len(self.ids):
            self.pool.release(self.ids[keep:])
            self.ids = self.ids[:keep]
            self._consecutive = min(self._consecutive, keep)
            self.tensor[keep:].fill_(SCRATCH)

    def release(self) -> None:
        self.truncate(0)

    def share_from(self, other: BlockTable, n: int) -> None:
        """List the other table's first n blocks as this sequence's first ones too (a shared prefix)."""
        ids = other.ids[:n]
        self.pool.retain(ids)
        self.add(ids, front=True)

    def move_from(self, other: BlockTable) -> None:
        """Take over another table's blocks as this sequence's first ones; the other is left empty."""
        ids, other.ids, other._consecutive = other.ids, [], 0
        other.tensor.fill_(SCRATCH)
        self.add(ids, front=True)

    def slots(self, positions: torch.Tensor) -> torch.Tensor:
        """Store rows of the sequence's positions (a device tensor: what a captured graph replays)."""
        return self.tensor[positions // PAGE].long() * PAGE + positions % PAGE

    def run(self, tokens: int) -> int | None:
        """The first row when the first `tokens` tokens lie in consecutive rows (their blocks are consecutive
        ids), else None: a reader may then take a slice instead of a gather."""
        if not tokens:
            return 0
        return self.ids[0] * PAGE if pages(tokens) <= self._consecutive else None

    def _write(self, start: int) -> None:
        from ..transfer import to_device

        self.tensor[start:len(self.ids)].copy_(to_device(self.ids[start:], self.pool.device, torch.int32))
