"""Everything a model keeps for one sequence between steps."""
from __future__ import annotations

from dataclasses import dataclass

from .kv_cache import KVCache


@dataclass
class SequenceCache:
    kv: KVCache
    states: object | None = None  # recurrent state of linear-attention layers (hybrid models)
    length: int = 0  # tokens already written

    @property
    def capacity(self) -> int:
        return self.kv.max_len
