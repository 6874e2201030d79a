"""Recurrent state of the linear-attention (Gated DeltaNet) layers of one sequence.

The state is the whole past of the sequence for those layers, so prefix reuse keeps (or snapshots) it and
speculative decoding restores it; `snapshot`/`restore` are the one mechanism both use.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..transfer import to_host


@dataclass
class GDNState:
    conv: torch.Tensor  # [layers, K-1, conv_dim], model dtype: the last K-1 conv inputs
    recurrent: torch.Tensor  # [layers, Hv, Dk, Dv], fp32 (fp64 when the model runs in fp64)

    @classmethod
    def zeros(cls, layers: int, conv_width: int, conv_dim: int, heads: int, dk: int, dv: int,
              dtype: torch.dtype, device: torch.device) -> GDNState:
        return cls(torch.zeros(layers, conv_width - 1, conv_dim, dtype=dtype, device=device),
                   torch.zeros(layers, heads, dk, dv, dtype=torch.promote_types(dtype, torch.float32), device=device))

    def snapshot(self, host: bool = False) -> GDNState:
        """A copy; in host memory when `host` (a held conversation's, with the host tier on)."""
        if host:
            return GDNState(to_host(self.conv), to_host(self.recurrent))
        return GDNState(self.conv.clone(), self.recurrent.clone())

    def clear(self) -> None:
        """The state of an empty sequence (zeros)."""
        self.conv.zero_()
        self.recurrent.zero_()

    def restore(self, other: GDNState) -> None:
        self.conv.copy_(other.conv)
        self.recurrent.copy_(other.recurrent)

    def rollback(self, kept: KeptInputs, keep: int) -> None:
        """Go to the state after the first `keep` tokens of the verify step that kept `kept`: the conv state from
        its window (one copy, where tokens were dropped); the recurrent state, which the step left as it was, by
        replaying the kept tokens from their saved inputs (one launch over all layers)."""
        if keep < kept.inputs.shape[1]:
            self.conv.copy_(kept.window[:, keep:keep + self.conv.shape[1]])
        kept.replay(kept, self.recurrent, keep)

    @property
    def nbytes(self) -> int:
        return self.conv.nbytes + self.recurrent.nbytes


@dataclass
class KeptInputs:
    """What a verify step keeps of every GDN layer until `commit`: each token's inputs to the recurrent update (the
    conv output rows [layers, T, C] and raw b, a [layers, 2, T, Hv]: ~40 KB per token and layer, where the state
    after each token was 3 MB) and the conv window [layers, K-1+T, C] (the conv state after token j is
    window[:, j+1 : j+K]); `replay(kept, recurrent, keep)` applies the kept tokens (the model's, which holds the
    layers' decay parameters). One tensor each for all layers."""

    inputs: torch.Tensor
    gates: torch.Tensor
    window: torch.Tensor
    replay: Callable[[KeptInputs, torch.Tensor, int], None]

    @classmethod
    def like(cls, state: GDNState, t: int, heads: int, replay: Callable[[KeptInputs, torch.Tensor, int], None]
             ) -> KeptInputs:
        layers, width, channels = state.conv.shape
        return cls(state.conv.new_empty(layers, t, channels), state.conv.new_empty(layers, 2, t, heads),
                   state.conv.new_empty(layers, width + t, channels), replay)
