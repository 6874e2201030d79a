"""Recurrent state of the linear-attention (Gated DeltaNet) layers of one sequence.

The state is the whole past of the sequence for those layers, so prefix reuse keeps (or snapshots) it and
speculative decoding restores it; `snapshot`/`restore` are the one mechanism both use.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class GDNState:
    conv: torch.Tensor  # [layers, K-1, conv_dim], model dtype: the last K-1 conv inputs
    recurrent: torch.Tensor  # [layers, Hv, Dk, Dv], fp32 (fp64 when the model runs in fp64)

    @classmethod
    def zeros(cls, layers: int, conv_width: int, conv_dim: int, heads: int, dk: int, dv: int,
              dtype: torch.dtype, device: torch.device) -> GDNState:
        return cls(torch.zeros(layers, conv_width - 1, conv_dim, dtype=dtype, device=device),
                   torch.zeros(layers, heads, dk, dv, dtype=torch.promote_types(dtype, torch.float32), device=device))

    def snapshot(self) -> GDNState:
        return GDNState(self.conv.clone(), self.recurrent.clone())

    def restore(self, other: GDNState) -> None:
        self.conv.copy_(other.conv)
        self.recurrent.copy_(other.recurrent)

    def rollback(self, steps: StepStates, keep: int) -> None:
        """Go back to the state after the first `keep` tokens of the step that kept `steps`: two copies over all
        layers (one per layer cost ~96 launches, issued one by one on the host, in every partly accepted round)."""
        if keep == steps.recurrent.shape[1]:
            return  # every token stays: the state is already the last one
        self.recurrent.copy_(steps.recurrent[:, keep - 1])
        self.conv.copy_(steps.window[:, keep:keep + self.conv.shape[1]])

    @property
    def nbytes(self) -> int:
        return self.conv.nbytes + self.recurrent.nbytes


@dataclass
class StepStates:
    """What a verify step keeps of every GDN layer until `commit`: the recurrent state after each of its T tokens
    [layers, T, H, Dk, Dv] and the conv window [layers, K-1+T, C] (the conv state after token j is window[:, j+1 :
    j+K]). One tensor each for all layers, so a rollback is two copies."""

    recurrent: torch.Tensor
    window: torch.Tensor

    @classmethod
    def like(cls, state: GDNState, t: int) -> StepStates:
        layers, width, channels = state.conv.shape
        return cls(state.recurrent.new_empty(layers, t, *state.recurrent.shape[1:]),
                   state.conv.new_empty(layers, width + t, channels))
