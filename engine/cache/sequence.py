"""Everything a model keeps for one sequence between steps."""
from __future__ import annotations

from dataclasses import dataclass

from .kv_cache import KVCache
from .state_slots import StepStates


@dataclass
class SequenceCache:
    kv: KVCache
    states: object | None = None  # recurrent state of linear-attention layers (hybrid models)
    length: int = 0  # tokens already written
    steps: StepStates | None = None  # what the last verify step kept of the GDN layers, until `commit`
    draft: object | None = None  # the drafter's own per-sequence state (its KV), kept with the sequence

    @property
    def capacity(self) -> int:
        return self.kv.max_len

    def commit(self, fed: int, keep: int) -> None:
        """After a step that ran `fed` tokens, keep only the first `keep` of them: attention KV is cut by the
        length alone; the recurrent state goes back to the one after token `keep` (a rejected draft suffix, or
        the padding of a graph step)."""
        if self.steps is not None:
            self.states.rollback(self.steps, keep)
        self.steps = None
        self.length -= fed - keep

    def reset(self) -> None:
        """Empty, for a new sequence: no tokens, zero recurrent state, no drafter state."""
        self.length, self.steps, self.draft = 0, None, None
        if self.states is not None:
            self.states.conv.zero_()
            self.states.recurrent.zero_()

    def detach_copy(self, kv_to_host: bool = False, states_to_host: bool = False) -> SequenceCache:
        """A compact copy of the sequence (its KV cut to its length) to hold, its KV and its recurrent state in
        host memory when asked (the host tier); the drafter state moves to it as it is."""
        states = self.states.snapshot(states_to_host) if self.states is not None else None
        held = SequenceCache(kv=self.kv.copy_prefix(self.length, kv_to_host), states=states, length=self.length,
                             draft=self.draft)
        self.draft = None
        return held

    def load(self, other: SequenceCache, n: int, states=None) -> None:
        """Become the first n tokens of `other`, with `states` (a checkpoint taken at n) or other's own."""
        self.reset()
        self.kv.copy_from(other.kv, n)
        if self.states is not None:
            self.states.restore(states if states is not None else other.states)
        self.length, self.draft = n, other.draft
