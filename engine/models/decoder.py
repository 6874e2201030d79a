"""What the decoder-only models share about running rows of several sequences in one step: a step's rows are
grouped in segments (one per sequence, each over its own cache), and the batched decode step built on that."""
from __future__ import annotations

import torch

from ..cache.sequence import SequenceCache
from ..kernels.actquant import QuantRows
from ..transfer import to_device
from .layers import cached_attention, output_logits

# The rows of a step that belong to one sequence: (its cache, its first row). The cache's length is still the
# count before the step while the decoder runs (forward moves it on afterwards).
Segment = tuple[SequenceCache, int]


def segment_rows(segments: list[Segment], rows: int):
    """(cache, row slice) per segment; a segment runs to the next one's first row."""
    for i, (cache, first) in enumerate(segments):
        end = segments[i + 1][1] if i + 1 < len(segments) else rows
        yield cache, slice(first, end)


def joined(parts: list[torch.Tensor]) -> torch.Tensor:
    """The segments' outputs as the step's rows."""
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def segment_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, segments: list[Segment], layer: int,
                      positions: torch.Tensor, scale: float, gate: torch.Tensor | None = None,
                      feeds=None) -> torch.Tensor | QuantRows:
    """Each sequence's rows of a step: their K/V written into its cache at `positions`, their queries [T, H, D]
    attending over its keys (times sigmoid(gate) when gated). With one sequence and `feeds` (the weight the
    output goes into), the output may come as QuantRows of [T, H * D] (see `cached_attention`)."""
    outs = []
    feeds = feeds if len(segments) == 1 else None  # the segments' outputs are joined: plain tensors
    for cache, r in segment_rows(segments, q.shape[0]):
        cache.kv.write(layer, positions[r], k[r], v[r])
        outs.append(cached_attention(q[r], cache.kv, layer, cache.length, positions[r], scale,
                                     gate[r] if gate is not None else None, feeds))
    return joined(outs)


class BatchStep:
    """`forward_batch` for a model with `_decoder(ids, segments, positions, capture)` (the hidden states before
    the final norm) and `ZERO_CENTRED_NORM` (its final norm's weight order)."""

    ZERO_CENTRED_NORM = False

    def prefill_piece(self, tokens: int) -> int:
        """Tokens per step for a prefill chunk of `tokens` tokens: 0, one eager step (the graph runner's
        `prefill_piece` may split a short chunk into graphed pieces)."""
        return 0

    def forward_batch(self, ids: torch.Tensor, caches: list[SequenceCache],
                      positions: torch.Tensor | None = None) -> torch.Tensor:
        """One decode token for each of B sequences (ids [B], token b after caches[b].length cached ones):
        the weights are read once for all B rows, attention (and a hybrid model's recurrence) run per sequence
        over its own cache. Returns logits [B, vocab] in fp32. `positions` [B] (each cache's length) is given
        by a graph runner, whose buffer outlives the capture."""
        if positions is None:
            positions = to_device([c.length for c in caches], self.device)
        for c in caches:
            c.steps = None
        x = self._decoder(ids, [(c, b) for b, c in enumerate(caches)], positions, None)
        for c in caches:
            c.length += 1
        return output_logits(x, self.norm, self.lm_head, self.spec.rms_eps, self.ZERO_CENTRED_NORM, True, None)
