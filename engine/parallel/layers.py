"""One rank's model: the model class itself over the rank's geometry (`shards.local_spec`) and its pieces of the
weights, the weights whose output must cross ranks wrapped in objects that do it. The model reads them as it
reads any packed weight (`models.layers.linear` calls `matmul`, `embed` calls `rows`), so the model code knows
nothing of ranks: one all-reduce after each attention/GDN output projection and each down projection, one
all-reduce of the embedding rows and one all-gather of the logits per step."""
from __future__ import annotations

import torch

from ..models import model_class
from ..models.layers import embed, linear
from ..quant.packed import PackedWeight
from .comm import Comm
from .shards import local_spec, split_of


class AllReduced(PackedWeight):
    """A row-parallel weight (its input columns cut over the ranks): each rank's product is a partial sum of the
    whole one; their sum is the output every rank goes on with. Given back dense (never a split-K partial): the
    sum must be whole before the residual norm reads it."""

    def __init__(self, inner, comm: Comm) -> None:
        self.inner, self.comm = inner, comm
        self.out_features, self.in_features = inner.shape
        self.compute_dtype = inner.dtype

    @property
    def device(self) -> torch.device:
        return self.inner.device

    def matmul(self, x, partial: bool = False) -> torch.Tensor:
        return self.comm.all_reduce(linear(x, self.inner))


class VocabShard(PackedWeight):
    """The embedding or the LM head cut over the vocabulary: this rank holds the rows of token ids
    first .. first + n - 1. It looks whole to the model (shape [vocab, hidden]): a lookup takes the rows of the ids
    it holds, zeros for the others, summed over the ranks (each id's row comes from one rank, exactly); a matmul
    gives its slice of the logits, gathered in rank order into the whole vocabulary."""

    def __init__(self, inner, comm: Comm) -> None:
        self.inner, self.comm = inner, comm
        n, self.in_features = inner.shape
        self.first, self.n = comm.rank * n, n
        self.out_features = n * comm.world
        self.compute_dtype = inner.dtype

    @property
    def device(self) -> torch.device:
        return self.inner.device

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.first
        held = (local >= 0) & (local < self.n)
        x = embed(local.clamp(0, self.n - 1), self.inner)
        return self.comm.all_reduce(x.masked_fill_(~held[:, None], 0))

    def matmul(self, x, partial: bool = False) -> torch.Tensor:
        return self.comm.all_gather(linear(x, self.inner))


def wrap(weights: dict, comm: Comm) -> dict:
    """A rank's loaded pieces (`shards.shard_transform`) with the cross-rank weights wrapped, in place."""
    for name, w in weights.items():
        split = split_of(name)
        if split is not None and split.comm == "sum":
            weights[name] = AllReduced(w, comm)
        elif split is not None and split.comm == "vocab":
            weights[name] = VocabShard(w, comm)
    return weights


def shard_model(geometry, weights: dict, kv_dtype: str, comm: Comm):
    """This rank's model over its pieces of the weights (`geometry`: the whole model's); it takes part in
    each step's collectives, so every rank runs the same steps."""
    return model_class(geometry)(local_spec(geometry, comm.world), wrap(weights, comm), kv_dtype)
