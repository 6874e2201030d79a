"""Everything a model keeps for one sequence between steps."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from .kv_cache import HostKV, KVCache, copy_tokens
from .kv_pool import PAGE, BlockTable
from .state_slots import KeptInputs

if TYPE_CHECKING:
    from ..media.prompt import PromptMedia


@dataclass
class SequenceCache:
    kv: KVCache | HostKV  # HostKV: a held conversation's, in the host tier
    states: object | None = None  # recurrent state of linear-attention layers (hybrid models)
    length: int = 0  # tokens already written
    kept: KeptInputs | None = None  # what the last verify step kept of the GDN layers, until `commit`
    draft: object | None = None  # the drafter's own per-sequence state (its KV), kept with the sequence
    # While a request runs in it: the tokens it may hold (prompt + max_tokens, in blocks) and how it gets more
    # blocks as it grows (`ensure`); without, all its blocks are there from the start.
    limit: int | None = None
    grow: Callable[[int], None] | None = None
    # While a request with images runs in it: their M-RoPE positions and embeddings (`media/prompt.py`)
    media: PromptMedia | None = None

    @property
    def capacity(self) -> int:
        """Tokens the sequence may hold."""
        return self.limit if self.limit is not None else self.kv.capacity

    def ensure(self, tokens: int) -> None:
        """Blocks for the first `tokens` tokens, before a step writes them."""
        if tokens <= self.kv.capacity:
            return
        if self.grow is None or tokens > self.capacity:
            raise ValueError(f"{tokens} tokens exceed the sequence's {self.capacity}")
        self.grow(tokens)

    def commit(self, fed: int, keep: int) -> None:
        """After a step that ran `fed` tokens, keep only the first `keep` of them: attention KV is cut by the
        length alone; the recurrent state goes back to the one after token `keep` (a rejected draft suffix, or
        the padding of a graph step)."""
        if self.kept is not None:
            self.states.rollback(self.kept, keep)
        self.kept = None
        self.length -= fed - keep

    def reset(self) -> None:
        """Empty, for a new sequence: no tokens, zero recurrent state, no drafter state."""
        self.length, self.kept, self.draft, self.media = 0, None, None, None
        if self.states is not None:
            self.states.clear()

    def detach(self, kv_to_host: bool = False, states_to_host: bool = False) -> SequenceCache:
        """The sequence as a held conversation: its KV blocks (cut to its length) move to it, or with
        `kv_to_host` its KV is copied to host memory and the blocks go back to the pool; its recurrent state is
        copied (to host memory with `states_to_host`); the drafter state moves to it as it is. This cache is left
        without blocks."""
        states = self.states.snapshot(states_to_host) if self.states is not None else None
        table = self.kv.table
        if kv_to_host:
            kv = HostKV(table, self.length)
            table.release()
        else:
            table.truncate(self.length)
            kv = KVCache(self.kv.store, BlockTable(table.pool, self.length))
            kv.table.move_from(table)
        held = SequenceCache(kv=kv, states=states, length=self.length, draft=self.draft)
        self.draft = None
        return held

    def load(self, other: SequenceCache, n: int, states=None, share: bool = False) -> None:
        """Become the first n tokens of `other`, a held conversation: take over its KV blocks (cut to n by its taker,
        `Engine._claim`) as its first ones (the blocks this cache holds already follow them), or with `share`
        (the held one stays held) list its full blocks of those tokens too and copy the rest into the first
        block this cache holds; host KV is copied into the blocks this cache holds. The recurrent state is
        `states` (a checkpoint taken at n) or other's own. The drafter's state moves along when taken; a
        sharer's drafter starts afresh at n (its KV rows below n are the shared blocks', which it does not
        write)."""
        self.reset()
        table = self.kv.table
        if isinstance(other.kv, HostKV):
            if table.capacity < n:
                raise ValueError(f"{n} tokens of a held conversation do not fit {table.capacity} tokens of blocks")
            other.kv.copy_to(table, n)
        elif share:
            full = n // PAGE
            table.share_from(other.kv.table, full)
            copy_tokens(other.kv.table, table, full * PAGE, n)
        else:
            table.move_from(other.kv.table)
        if self.states is not None:
            self.states.restore(states if states is not None else other.states)
        self.length, self.draft = n, None if share else other.draft

    def release(self) -> None:
        """Give the KV blocks back to the pool (a held conversation dropped, a request's end)."""
        if isinstance(self.kv, KVCache):
            self.kv.table.release()
        self.limit = self.grow = None
