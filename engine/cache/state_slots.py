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

    def rollback(self, steps: list, keep: int) -> None:
        """Go back to the state after the first `keep` tokens of the last step; `steps` holds per layer the
        recurrent state after each token [T, H, Dk, Dv] and the conv window [K-1+T, C]."""
        width = self.conv.shape[1]
        if keep == steps[0][0].shape[0]:
            return  # every token stays: the state is already the last one
        for slot, (recurrent, window) in enumerate(steps):
            self.recurrent[slot] = recurrent[keep - 1]
            self.conv[slot] = window[keep:keep + width]

    @property
    def nbytes(self) -> int:
        return self.conv.nbytes + self.recurrent.nbytes
