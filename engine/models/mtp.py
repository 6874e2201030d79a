"""The Qwen3.5/3.6 multi-token-prediction (MTP) head as a drafter.

Layout as vLLM's Qwen3_5MultiTokenPredictor (transformers does not load `mtp.*`): for position i, the input
is fc([pre_fc_norm_embedding(embed(token i+1)) ; pre_fc_norm_hidden(h_i)]) with h_i the target's post-norm
hidden state; one gated full-attention decoder layer with its own KV cache; `mtp.norm`; the target's LM head.
Drafting k tokens applies it recursively, feeding its own output hidden state and guess back in.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..cache.kv_pool import StoreSpec
from ..cache.sequence import SequenceCache
from ..cuda_graphs import MAX_GRAPH_TOKENS, BoundGraphs
from ..errors import ModelFormatError
from ..kernels.actquant import QuantRows
from ..transfer import to_device
from .layers import add_rms_norm, embed, linear, rms_norm, swiglu
from .qwen3_5 import Qwen35Model, attention_layer, mtp_shapes
from .taps import Taps


@dataclass
class MTPState:
    seq: SequenceCache  # the MTP layers' KV, one entry per target position
    hidden: torch.Tensor | None = None  # output at the last observed position, and its logits: the first guess
    logits: torch.Tensor | None = None


class MTPDrafter:
    def __init__(self, target: Qwen35Model, graphs: bool = False) -> None:
        """`graphs`: replay each k-token draft, and each round's step over the accepted tokens, as one CUDA
        graph (eager, their ~40 small launches per token cost more host time than the GPU spends on them)."""
        s = target.geometry
        if not s.mtp_layers or not target.mtp:
            raise ModelFormatError("spec = \"mtp\" needs the checkpoint's MTP weights (mtp.*), and this model has "
                                   "none", hint="use a checkpoint that keeps mtp.* (many quantized exports drop "
                                   "it), or spec = \"ngram\"")
        for name, shape in mtp_shapes(s).items():
            got = target.mtp.get(name)
            if got is None:
                raise ModelFormatError(f"MTP weights lack tensor {name!r}")
            if tuple(got.shape) != shape:
                raise ModelFormatError(f"MTP tensor {name!r} has shape {tuple(got.shape)}; the target "
                                       f"(hidden {s.hidden_size}) implies {shape}")
        self.target = target
        w = target.mtp
        self.fc, self.norm = w["mtp.fc.weight"], w["mtp.norm.weight"]
        self.norm_embed, self.norm_hidden = w["mtp.pre_fc_norm_embedding.weight"], w["mtp.pre_fc_norm_hidden.weight"]
        self.layers = [attention_layer(w, f"mtp.layers.{i}.") for i in range(s.mtp_layers)]
        self.head = target.lm_head  # what the guesses are scored with (`make_drafter` may cut it)
        self.graphs = BoundGraphs() if graphs and target.device.type == "cuda" else None
        # the MTP layer's KV per target token, in the target's pool: the sequence's blocks index it too
        self.kv_store = ("mtp", StoreSpec(len(self.layers), s.num_kv_heads, s.head_dim, target.kv_dtype,
                                          target.dtype))

    def taps(self) -> Taps:
        return Taps(final=True)

    def prepare(self, cache: SequenceCache) -> None:
        state: MTPState | None = cache.draft
        kv = cache.kv.view(*self.kv_store)
        if state is None:  # from the sequence's length: a shared prefix's rows are in its blocks
            cache.draft = state = MTPState(SequenceCache(kv=kv, length=cache.length))
        state.seq.kv = kv
        state.seq.length = min(state.seq.length, cache.length)
        state.hidden = state.logits = None

    def _step(self, state: MTPState, ids: torch.Tensor, hidden: torch.Tensor, layer: int,
              positions: torch.Tensor | None = None):
        """Run the MTP layer over positions state.seq.length.. (or `positions`, on the device: a captured graph's
        buffer) for token ids on the device; returns (last output, its logits)."""
        t, s = self.target, self.target.geometry
        e = rms_norm(embed(ids, t.embed), self.norm_embed, s.rms_eps, zero_centred=True)
        h = rms_norm(hidden, self.norm_hidden, s.rms_eps, zero_centred=True)
        x = linear(torch.cat([e, h], dim=-1), self.fc)
        start = state.seq.length
        if positions is None:
            positions = torch.arange(start, start + ids.shape[0], device=t.device)
        cos, sin = t.rope.cos_sin(positions, t.dtype)
        w = self.layers[layer]
        a = rms_norm(x, w["in_norm"], s.rms_eps, zero_centred=True, feeds=w["qkv"])
        x, a = add_rms_norm(x, t.attention(a, w, [(state.seq, 0)], layer, positions, cos, sin), w["post_norm"],
                            s.rms_eps, zero_centred=True, feeds=w["gate_up"])
        x = x + swiglu(a, w["gate_up"], w["down"])
        state.seq.length = start + ids.shape[0]
        # the norm also writes the head's int8 rows; the hidden state fed back is its plain output
        out = rms_norm(x[-1:], self.norm, s.rms_eps, zero_centred=True, feeds=self.head)
        return (out.x if isinstance(out, QuantRows) else out), linear(out, self.head)[0]

    def observe(self, cache: SequenceCache, ids: list[int], taps: Taps | None, next_token: int) -> None:
        state: MTPState = cache.draft
        t = self.target
        ids = to_device(ids[1:] + [next_token], t.device)
        n, start = ids.shape[0], state.seq.length
        if self.graphs is not None and n <= MAX_GRAPH_TOKENS:  # a round's accepted tokens; prefill chunks: eager
            positions = torch.arange(start, start + n, device=t.device)
            step = self._at(state, start, lambda i, h, p: self._step(state, i, h, 0, p))
            state.hidden, state.logits = self.graphs.replay(("observe", n), state.seq.kv.table.tensor, step, ids,
                                                            taps.hidden, positions)
            state.seq.length = start + n
        else:
            state.hidden, state.logits = self._step(state, ids, taps.hidden, 0)

    def propose(self, cache: SequenceCache, history: list[int], k: int) -> list[int] | torch.Tensor:
        state: MTPState = cache.draft
        if state.logits is None:
            return []
        committed = state.seq.length
        if self.graphs is not None and k > 1:
            positions = torch.arange(committed, committed + k - 1, device=self.target.device)
            draft = self._at(state, committed, lambda lg, h, p: (self._draft(state, lg, h, k, p),))
            guesses = self.graphs.replay(("propose", k), state.seq.kv.table.tensor, draft, state.logits, state.hidden,
                                         positions)[0]
        else:
            guesses = self._draft(state, state.logits, state.hidden, k)
        state.seq.length = committed  # the recursive entries were guesses; the next observe overwrites them
        return guesses

    def propose_rows(self, caches: list[SequenceCache], histories: list[list[int] | None],
                     ks: list[int]) -> list[list[int] | torch.Tensor]:
        """Each sequence's `propose` in turn: a draft's steps follow one another, each over its sequence's KV."""
        return [self.propose(c, h, k) if h is not None else [] for c, h, k in zip(caches, histories, ks, strict=True)]

    def _draft(self, state: MTPState, logits: torch.Tensor, hidden: torch.Tensor, k: int,
               positions: torch.Tensor | None = None) -> torch.Tensor:
        """k guesses, kept on the device (one host sync for the whole draft)."""
        guesses = [logits.argmax().view(1)]
        for j in range(1, k):
            pos = positions[j - 1:j] if positions is not None else None
            hidden, logits = self._step(state, guesses[-1], hidden, j % len(self.layers), pos)
            guesses.append(logits.argmax().view(1))
        return torch.cat(guesses)

    @staticmethod
    def _at(state: MTPState, length: int, fn):
        """fn run from the MTP cache length `length` and leaving it there (a graph's captures run it thrice)."""
        def run(*inputs):
            state.seq.length = length
            out = fn(*inputs)
            state.seq.length = length
            return out
        return run
