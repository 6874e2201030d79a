"""Everything a model keeps for one sequence between steps."""
from __future__ import annotations

from dataclasses import dataclass

from .kv_cache import KVCache


@dataclass
class SequenceCache:
    kv: KVCache
    states: object | None = None  # recurrent state of linear-attention layers (hybrid models)
    length: int = 0  # tokens already written
    # Per-step recurrent states and conv windows of the last verify step, per GDN layer, until `commit`.
    steps: list | None = None
    draft: object | None = None  # the drafter's own per-sequence state (its KV), kept with the sequence

    @property
    def capacity(self) -> int:
        return self.kv.max_len

    def commit(self, fed: int, keep: int) -> None:
        """After a step that ran `fed` tokens, keep only the first `keep` of them: attention KV is cut by the
        length alone; the recurrent state goes back to the one after token `keep` (a rejected draft suffix)."""
        if keep < fed and self.steps is not None:
            self.states.rollback(self.steps, keep)
        self.steps = None
        self.length -= fed - keep
