"""Speculative decoding: drafters that guess the next tokens, checked by the target in one step
(the round logic is in runtime/generate.py, acceptance in runtime/sampler.py)."""
from __future__ import annotations

from typing import Protocol

import torch

from ...cache.kv_pool import StoreSpec
from ...cache.sequence import SequenceCache
from ...cuda_graphs import BoundGraphs
from ...models.taps import Taps


class Drafter(Protocol):
    """Guesses the next tokens of a sequence; the target model checks them. The defaults suit a drafter that
    keeps no state of its own and reads no hidden states (it subclasses this and writes `propose` only)."""

    # Whether `propose` runs the target on its cache. A round otherwise commits the previous round's tokens to
    # the target's cache after `observe` and `propose` (runtime/generate.py), so neither may read it.
    reads_target_cache: bool = False
    # The KV it keeps per token of the target's sequence, as a store of the target's pool: (key, spec), or None.
    kv_store: tuple[str, StoreSpec] | None = None
    # The CUDA graphs its steps replay, or None (eager). The graph runner captures those a round can replay for
    # each lane before any request runs (`GraphRunner.capture_all`).
    graphs: BoundGraphs | None = None

    def taps(self) -> Taps | None:
        """The hidden states it needs from each target step (a fresh Taps), or None."""
        return None

    def prepare(self, cache: SequenceCache) -> None:
        """Create or cut its per-sequence state (`cache.draft`) to match `cache.length`."""

    def observe(self, cache: SequenceCache, ids: list[int], taps: Taps | None, next_token: int) -> None:
        """The target kept `ids` (the last tokens of the cache, with `taps` of exactly those positions);
        `next_token` follows them."""

    def propose(self, cache: SequenceCache, history: list[int], k: int) -> list[int] | torch.Tensor:
        """Up to k guesses of the tokens after `history` (whose last token is not in the cache yet): host ids,
        or a device tensor (valid until the next call) when the drafter made them on the device, so the round
        reads them together with the accepted count in its one host sync."""
        ...

    def propose_rows(self, caches: list[SequenceCache], histories: list[list[int] | None],
                     ks: list[int]) -> list[list[int] | torch.Tensor]:
        """`propose` for several sequences at once (a drafter with a forward batches them); a None history pads a
        captured batch and gets no guesses."""
        return [self.propose(c, h, k) if h is not None else [] for c, h, k in zip(caches, histories, ks, strict=True)]
