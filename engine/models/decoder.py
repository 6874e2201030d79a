"""What the decoder-only models share about running rows of several sequences in one step: a step's rows are
grouped in segments (one per sequence, each over its own cache), and the batched decode step built on that."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..cache.sequence import SequenceCache
from ..kernels.actquant import QuantRows
from ..transfer import to_device
from .layers import cached_attention, linear, output_logits
from .taps import Taps

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


@dataclass
class Row:
    """One sequence's tokens in a step: `tokens` rows after `cache.length` cached ones."""

    cache: SequenceCache
    tokens: int
    keep_inputs: bool = False  # keep every token's recurrent-layer inputs until `cache.commit` (a verify step)
    all_logits: bool = False  # logits of every token (a verify step's), else of the last one


@dataclass
class StepMedia:
    """What a step's rows of prompts with images need: every row's M-RoPE coordinates, and the rows whose
    embeddings are the tower's."""

    positions: torch.Tensor  # [3, T]
    rows: torch.Tensor  # [k] step rows of image pads
    embeds: torch.Tensor  # [k, hidden]


def step_media(rows: list[Row], positions: torch.Tensor) -> StepMedia:
    """The StepMedia of a step's rows, from their caches' `media` (rows without images: their positions on
    every axis, from their lengths as `forward_rows` made them: such steps never run in graphs)."""
    coords, spliced, embeds, first = [], [], [], 0
    for r in rows:
        media = r.cache.media
        if media is None:
            coords.append(torch.arange(r.cache.length, r.cache.length + r.tokens).expand(3, -1))  # no device read
        else:
            coords.append(media.rope(r.cache.length, r.tokens))
            found = media.splice(r.cache.length, r.tokens)
            if found is not None:
                spliced.append(found[0] + first)
                embeds.append(found[1])
        first += r.tokens
    device = positions.device
    return StepMedia(torch.cat(coords, dim=1).to(device),
                     torch.cat(spliced).to(device) if spliced else torch.empty(0, dtype=torch.long, device=device),
                     torch.cat(embeds) if embeds else torch.empty(0, device=device))


class BatchStep:
    """The one forward of a decoder-only model with `_decoder(ids, segments, positions, taps)` (the hidden
    states before the final norm; a model with a vision tower takes `media=StepMedia` too),
    `_keep_inputs(cache, tokens)` (what a verify step keeps of its recurrent layers) and `ZERO_CENTRED_NORM` (its
    final norm's weight order)."""

    ZERO_CENTRED_NORM = False

    def prefill_piece(self, tokens: int) -> int:
        """Tokens per step for a prefill chunk of `tokens` tokens: 0, one eager step (the graph runner's
        `prefill_piece` may split a short chunk into graphed pieces)."""
        return 0

    def graphed(self, cache: SequenceCache) -> bool:
        """Whether steps on `cache` replay captured graphs: never here (the graph runner's lanes do)."""
        return False

    def draft_lanes(self, caches: list[SequenceCache]) -> list[SequenceCache] | None:
        """The caches a drafter's batch for `caches` runs over when that is a captured batch: none here (the
        graph runner's lanes are)."""
        return None

    def _keep_inputs(self, cache: SequenceCache, tokens: int) -> None:
        """A model with recurrent layers keeps their inputs here; attention KV alone is cut back by length."""
        cache.kept = None

    def forward_rows(self, ids: torch.Tensor, rows: list[Row], positions: torch.Tensor | None = None,
                     taps: Taps | None = None, rope_positions: torch.Tensor | None = None) -> torch.Tensor:
        """One step over the rows of several sequences (ids: their tokens one after another): a prefill chunk,
        a decode token, a verify step's pending token and drafts, in any mix. The weights are read once for all
        rows; attention (and a hybrid model's recurrence) runs per sequence over its own cache. Returns fp32
        logits of each row's last token, or of all its tokens (`Row.all_logits`), in row order. `positions`
        (each token's position, on the device) is given by a graph runner, whose buffer outlives the capture;
        so is `rope_positions` where they differ from the places in the cache: past a prompt with images a token
        turns by its place + the prompt's M-RoPE delta on every axis, i.e. by that one position."""
        if positions is None:
            positions = to_device([p for r in rows for p in range(r.cache.length, r.cache.length + r.tokens)],
                                  self.device)
        segments, first = [], 0
        for r in rows:
            if r.keep_inputs:
                self._keep_inputs(r.cache, r.tokens)
            else:
                r.cache.kept = None
            segments.append((r.cache, first))
            first += r.tokens
        if rope_positions is not None:  # equal coordinates on the three axes: M-RoPE turns as plain RoPE
            empty = rope_positions[:0]
            x = self._decoder(ids, segments, positions, taps,
                              media=StepMedia(rope_positions.expand(3, -1), empty, empty))
        elif any(r.cache.media is not None for r in rows):  # images: their embeddings and M-RoPE positions
            x = self._decoder(ids, segments, positions, taps, media=step_media(rows, positions))
        else:
            x = self._decoder(ids, segments, positions, taps)
        for r in rows:
            r.cache.length += r.tokens
        norm = (self.norm, self.lm_head, self.geometry.rms_eps, self.ZERO_CENTRED_NORM)
        if len(rows) == 1:
            return output_logits(x, *norm, rows[0].all_logits, taps)
        picked = [i for r, (_, f) in zip(rows, segments, strict=True)
                  for i in (range(f, f + r.tokens) if r.all_logits else (f + r.tokens - 1,))]
        if len(picked) == x.shape[0]:
            return output_logits(x, *norm, True, taps)
        idx = to_device(picked, self.device)
        if taps is not None and taps.final:  # the drafter reads every row's normed hidden state
            output_logits(x, *norm, False, taps)
            return linear(taps.hidden[idx], self.lm_head).to(torch.promote_types(x.dtype, torch.float32))
        return output_logits(x[idx], *norm, True, None)

    def forward(self, ids: torch.Tensor, cache: SequenceCache, all_logits: bool = False,
                taps: Taps | None = None, keep_inputs: bool = False, positions: torch.Tensor | None = None,
                rope_positions: torch.Tensor | None = None) -> torch.Tensor:
        """T new tokens of one sequence after `cache.length` cached ones: logits [T or 1, vocab] in fp32."""
        return self.forward_rows(ids, [Row(cache, ids.shape[0], keep_inputs, all_logits)], positions, taps,
                                 rope_positions)

    def forward_batch(self, ids: torch.Tensor, caches: list[SequenceCache], positions: torch.Tensor | None = None,
                      rope_positions: torch.Tensor | None = None, taps: Taps | None = None) -> torch.Tensor:
        """One decode token for each of B sequences (ids [B]): logits [B, vocab] in fp32 (and their rows of a
        drafter's `taps` when given)."""
        return self.forward_rows(ids, [Row(c, 1) for c in caches], positions, taps, rope_positions)
