"""Hidden states a drafter reads from a target forward (speculative decoding)."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class Taps:
    layer_ids: tuple[int, ...] = ()  # decoder layers whose outputs are kept (DFlash context features)
    final: bool = False  # keep the post-final-norm hidden states (MTP input)
    layers: dict[int, torch.Tensor] = field(default_factory=dict)
    hidden: torch.Tensor | None = None

    def keep(self, layer: int, x: torch.Tensor) -> None:
        if layer in self.layer_ids:
            self.layers[layer] = x

    def features(self) -> torch.Tensor:
        """The tapped layers' outputs side by side: [T, len(layer_ids) * hidden]."""
        return torch.cat([self.layers[i] for i in self.layer_ids], dim=-1)

    def first(self, n: int) -> Taps:
        """The taps of the first n positions (those a verify step kept)."""
        return self.rows(0, n)

    def rows(self, start: int, stop: int) -> Taps:
        """The taps of positions start..stop-1 (one sequence's rows of a step that ran several)."""
        return Taps(self.layer_ids, self.final, {i: x[start:stop] for i, x in self.layers.items()},
                    None if self.hidden is None else self.hidden[start:stop])
