"""What the model sees of a weight kept in a packed format (group-quantized, or GGUF blocks): its shape, the dtype
it computes in, `matmul(x, partial)` and `rows(ids)`; `models/layers.py` hands such weights their own work."""
from __future__ import annotations

import torch


class PackedWeight:
    out_features: int
    in_features: int
    compute_dtype: torch.dtype

    @property
    def shape(self) -> torch.Size:
        return torch.Size((self.out_features, self.in_features))

    @property
    def dtype(self) -> torch.dtype:
        """The dtype the weight computes in (what the model around it uses)."""
        return self.compute_dtype
