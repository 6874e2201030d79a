"""Token sampling: repetition penalty, temperature, top-k, top-p, min-p, seeded. Every pick is made on the device
without a host sync (`pick`); the caller reads the value when it needs it."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..kernels import runs_here
from ..kernels.argmax import greedy_verdict
from ..kernels.sampled_verdict import sampled_verdict
from ..models.rows import row_argmax, row_cumsum, row_max, row_sum, row_topk, row_topk_ids
from ..transfer import HostCopy, to_device
from .request import SamplingParams

Rider = Callable[[torch.Tensor], torch.Tensor]  # each row's chosen token -> float64 values read with the verdict


def apply_repetition_penalty(logits: torch.Tensor, seen: torch.Tensor, penalty: float) -> torch.Tensor:
    """HF/CTRL rule over tokens already in the sequence: positive logits divided, negative multiplied. A new
    tensor, made without reading the mask on the host."""
    return torch.where(seen, torch.where(logits > 0, logits / penalty, logits * penalty), logits)


def filtered_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The distribution a non-greedy sample is drawn from, after temperature, top-k, top-p and min-p (HF's rules,
    in HF's order); for each row of logits [..., vocab] (a verify step's rows in one go). No sort of the
    vocabulary when top-k is set: top-p then needs only the k ranked values. Filters act in logit space against
    a ranked value, so a token tied with the last one kept stays (HF's rule for top-k; for top-p HF's sort
    leaves ties in no defined order)."""
    vocab = logits.shape[-1]
    x = logits.float().reshape(-1, vocab) / params.temperature
    k = params.top_k if 0 < params.top_k < vocab else 0
    if k:
        ranked = row_topk(x, k)
    elif params.top_p < 1.0:
        ranked = x.sort(-1, descending=True).values
    else:
        ranked = row_max(x)
    e = torch.exp(x - ranked[:, :1])  # the unnormalised probabilities: the top token's is 1
    keep = x >= ranked[:, -1:] if k else None  # None: every token stays
    if params.top_p < 1.0:
        z = row_sum(e if keep is None else torch.where(keep, e, 0.0))
        p = torch.exp(ranked - ranked[:, :1]) / z  # the ranked tokens' probabilities after top-k
        ahead = row_cumsum(p) - p  # the mass before each: a token goes once it reaches top_p (the first stays)
        last = row_sum((ahead < params.top_p).float()).long() - 1
        keep = _both(keep, x >= ranked.gather(1, last))
    if params.min_p > 0.0:
        keep = _both(keep, e >= params.min_p)  # p < min_p * max(p), with the top token's e = 1
    if keep is not None:
        e = torch.where(keep, e, 0.0)
    return (e / row_sum(e)).view(logits.shape)


def _both(keep: torch.Tensor | None, also: torch.Tensor) -> torch.Tensor:
    return also if keep is None else keep & also


def draw(probs: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """One id drawn from `probs` [vocab] (need not sum to 1), as a 0-d device tensor, with no host sync: the
    exponential race: argmax of p_i / E_i with E_i ~ Exp(1) i.i.d. picks i with probability p_i / sum(p), so no
    normalisation is needed and nothing is read back to the host (the launch returns at once)."""
    return race_winner(probs, torch.empty_like(probs, dtype=torch.float32).exponential_(generator=generator))


def race_winner(probs: torch.Tensor, race: torch.Tensor) -> torch.Tensor:
    """argmax of probs / race: with race ~ Exp(1), i with probability p_i / sum(p) (`draw`)."""
    return torch.argmax(probs / race.clamp_min(torch.finfo(torch.float32).tiny))


# A top-k sampled verdict draws among each row's this many (or 2 x top-k) largest logits: a handful of small
# ops on [rows, 64] instead of ~20 over the whole vocabulary, each of which costs a read of every row.
CANDIDATES = 64


class Sampler:
    def __init__(self, params: SamplingParams, vocab_size: int, device: torch.device,
                 prompt_ids: list[int] | None = None) -> None:
        self.params = params
        self.generator = torch.Generator(device=device)
        if params.seed is None:
            self.generator.seed()
        else:
            self.generator.manual_seed(params.seed)
        self.seen = None
        if params.repetition_penalty != 1.0:
            self.seen = torch.zeros(vocab_size, dtype=torch.bool, device=device)
            if prompt_ids:
                self.seen[torch.tensor(prompt_ids, device=device)] = True

    def _penalised(self, logits: torch.Tensor) -> torch.Tensor:
        if self.seen is None:
            return logits
        return apply_repetition_penalty(logits, self.seen, self.params.repetition_penalty)

    def _chose(self, token: int) -> int:
        if self.seen is not None:
            self.seen[token] = True
        return token

    def pick(self, logits: torch.Tensor) -> torch.Tensor:
        """logits: [vocab] (fp32). The chosen id as a 0-d tensor on the logits' device, read by no one yet."""
        logits = self._penalised(logits)
        if self.params.greedy:
            token = torch.argmax(logits)
        elif runs_here(logits) and (picked := self._candidates(logits.view(1, -1))) is not None:
            token = self._device_verdict(logits.view(1, -1), *picked, None)[1]
        else:
            token = draw(filtered_probs(logits, self.params), self.generator)
        if self.seen is not None:
            self.seen.index_fill_(0, token.view(1), True)
        return token

    def _candidates(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Each row's `CANDIDATES` (or 2 x top-k) largest logits and their ids, largest first: what a top-k draw
        needs to look at (None without top-k, where every token may be drawn)."""
        vocab, top = logits.shape[-1], self.params.top_k
        if not 0 < top < vocab:
            return None
        return row_topk_ids(logits.float(), min(vocab, max(CANDIDATES, 2 * top)))

    def _device_verdict(self, logits: torch.Tensor, values: torch.Tensor, ids: torch.Tensor,
                        drafts: torch.Tensor | None) -> torch.Tensor:
        """[drafts kept, the token after them, the drafts] drawn on the device from each row's candidates
        (`kernels/sampled_verdict.py`: exact, ties at the top-k bound beyond them included), in a few launches
        where the vocabulary-wide filters took ~40; with no drafts (None), a plain pick."""
        u = None if drafts is None else torch.rand(drafts.shape[0], generator=self.generator, device=logits.device)
        race = torch.empty(values.shape[1] + 2, dtype=torch.float32, device=logits.device).exponential_(
            generator=self.generator)
        p = self.params
        return sampled_verdict(logits.float().contiguous(), values, ids, drafts, u, race, p.temperature, p.top_k,
                               p.top_p, p.min_p)

    def __call__(self, logits: torch.Tensor) -> int:
        """logits: [vocab] (fp32). Returns the chosen id."""
        return int(self.pick(logits))

    def accept(self, logits: torch.Tensor, drafts: list[int] | torch.Tensor) -> tuple[int, int, list[int]]:
        """Speculative verification. logits: [len(drafts) + 1, vocab], row i scoring the position after draft i
        (row 0: after the last accepted token); drafts as host ids or a device tensor. Returns (drafts accepted,
        the token that follows them, the drafts as host ids), read from the device in one sync.

        Greedy: a draft stays while it is the target's argmax. Sampling: drafts are point proposals (q = 1 on
        the drafted token), so draft i stays with probability p_i(d_i) and a rejection samples from p_i with
        d_i removed, renormalised: the standard rejection rule for that q, which leaves every emitted token
        distributed exactly as the target's sampler would draw it."""
        return self.accept_with(logits, drafts, None)[:3]

    def accept_with(self, logits: torch.Tensor, drafts: list[int] | torch.Tensor, rider: Rider | None
                    ) -> tuple[int, int, list[int], list[float]]:
        """`accept`, and what `rider` computes on the device from each row's chosen token [len(drafts) + 1]
        (row i < accepted: draft i; row accepted: the token that follows; later rows: not output), read in the
        same copy as the verdict (a request's logprobs: no second sync per round)."""
        verdict = self.verdict(logits, drafts, rider)
        if verdict is not None:
            return verdict.read(HostCopy(verdict.values).result().tolist())
        drafts = drafts.tolist() if isinstance(drafts, torch.Tensor) else drafts
        n, token = self._accept_in_turn(logits, drafts)
        chosen = [*drafts[:n], token] + drafts[n + 1:]  # a repetition penalty syncs each row anyway
        if rider is None:
            return n, token, drafts, []
        return n, token, drafts, HostCopy(rider(torch.tensor(chosen, device=logits.device))).result().tolist()

    def verdict(self, logits: torch.Tensor, drafts: list[int] | torch.Tensor, rider: Rider | None
                ) -> Verdict | None:
        """`accept_with` made on the device and not read yet, so that a step reads every request's verdict in one
        copy; None where a repetition penalty makes each row depend on the drafts before it (`accept_with` then
        decides row by row). Without a penalty every row's test is made at once (the same rule, so the same
        distribution: draft i stays with probability p_i(d_i), independently; the first rejection, or the row
        after the last draft, samples the token that follows)."""
        if self.seen is not None:
            return None
        k = len(drafts)
        logits = logits[:k + 1]
        if k == 0:
            token = self.pick(logits[0]).view(1)
            verdict = torch.cat([torch.zeros_like(token), token])
        else:
            # host drafts (n-gram, a grammar's) through pinned memory: a pageable copy would wait for the device
            d = drafts.long() if isinstance(drafts, torch.Tensor) else to_device(drafts, logits.device)
            if self.params.greedy:  # on a GPU the whole verdict in two launches
                verdict = greedy_verdict(logits, d) if runs_here(logits) else self._greedy_verdict(logits, d)
            else:
                verdict = self._sampled_verdict(logits, d)
        if rider is None:
            return Verdict(verdict.double(), k)
        rows = torch.arange(k + 1, device=verdict.device)
        chosen = torch.where(rows == verdict[0], verdict[1], torch.cat([verdict[2:2 + k], verdict[1:2]]))
        return Verdict(torch.cat([verdict.double(), rider(chosen)]), k)

    def _accept_in_turn(self, logits: torch.Tensor, drafts: list[int]) -> tuple[int, int]:
        for i, d in enumerate(drafts):  # a repetition penalty makes each row depend on the drafts before it
            row = self._penalised(logits[i])
            if self.params.greedy:
                best = int(torch.argmax(row))
                if best != d:
                    return i, self._chose(best)
            else:
                probs = filtered_probs(row, self.params)
                u = torch.rand((), generator=self.generator, device=probs.device)
                if not bool(u < probs[d]):
                    residual = probs.clone()
                    residual[d] = 0.0
                    return i, self._chose(int(draw(residual, self.generator)))
            self._chose(d)
        return len(drafts), self(logits[len(drafts)])

    @staticmethod
    def _greedy_verdict(logits: torch.Tensor, drafts: torch.Tensor) -> torch.Tensor:
        """[drafts kept, the token after them, the drafts] on the device (the reference of kernels/argmax.py's
        greedy verdict)."""
        k = drafts.shape[0]
        best = row_argmax(logits)
        n = _first(best[:k] != drafts, k)
        return torch.cat([n.view(1), best[n].view(1), drafts])

    def _sampled_verdict(self, logits: torch.Tensor, drafts: torch.Tensor) -> torch.Tensor:
        """[drafts kept, the token after them, the drafts] on the device. With top-k set, each row's distribution
        is computed over its `CANDIDATES` (or 2 x top-k) largest logits instead of the vocabulary: on a GPU in
        `kernels/sampled_verdict.py`, exact; in torch (`verdict_reference`) the same numbers when every token the
        filters keep is among them, which only a tie of that many tokens at the top-k bound breaks (flagged; the
        flag depends on the logits alone, so drawing again over the vocabulary keeps the distribution exact)."""
        picked = self._candidates(logits)
        if picked is not None and runs_here(logits):
            return self._device_verdict(logits, *picked, drafts)
        if picked is not None:
            missable = picked[0].shape[-1] < logits.shape[-1]  # fewer candidates than tokens
            verdict = self._reference_verdict(*picked, drafts, check_missed=missable)
            if not int(verdict[-1]):  # on the CPU (the device paths are above): reading costs no sync
                return verdict[:-1]
        return self._reference_verdict(logits, None, drafts, check_missed=False)[:-1]

    def _reference_verdict(self, logits: torch.Tensor, ids: torch.Tensor | None, drafts: torch.Tensor,
                           check_missed: bool) -> torch.Tensor:
        """`verdict_reference` on random numbers of this sampler's generator."""
        u = torch.rand(drafts.shape[0], generator=self.generator, device=logits.device)
        race = torch.empty(logits.shape[-1], dtype=torch.float32, device=logits.device).exponential_(
            generator=self.generator)
        return verdict_reference(logits, ids, drafts, u, race, self.params, check_missed)


def verdict_reference(logits: torch.Tensor, ids: torch.Tensor | None, drafts: torch.Tensor, u: torch.Tensor,
                      race: torch.Tensor, params: SamplingParams, check_missed: bool) -> torch.Tensor:
    """The sampled verdict in torch (the reference of `kernels/sampled_verdict.py` wherever no tie at a row's
    top-k bound reaches past its candidates, the flag's case): logits [k + 1, n] over the vocabulary
    (ids None) or over each row's n largest, largest first (their token ids `ids`); u [k] uniforms, race [n]
    Exp(1) draws. Returns [drafts kept, the token after them, the drafts, the missed flag]."""
    k, top = drafts.shape[0], params.top_k
    missed = torch.zeros((), dtype=torch.long, device=logits.device)
    if check_missed:
        missed = (logits[:, -1] >= logits[:, top - 1]).any().long()
    probs = filtered_probs(logits, params)  # [k + 1, vocab or candidates]
    # each row's draft as a column of `probs`, -1 where it has none: row k, or a draft outside the candidates
    # (probability 0 there)
    col = torch.cat([drafts, drafts.new_full((1,), -1)])
    if ids is not None:
        hit = ids == col[:, None]
        col = torch.where(hit.any(1), hit.int().argmax(1), -1)
    at = col.clamp_min(0)
    n = _first(u >= torch.where(col[:k] >= 0, probs[:k].gather(1, at[:k, None])[:, 0], 0.0), k)
    # a rejected draft's row samples from p without the draft; the row after the last draft from p itself
    row = probs[n]
    row = row.scatter(0, at[n].view(1), torch.where(col[n] >= 0, 0.0, row[at[n]]).view(1))
    token = race_winner(row, race)
    if ids is not None:
        token = ids[n, token]
    return torch.cat([n.view(1), token.view(1), drafts, missed.view(1)])


def _first(rejected: torch.Tensor, k: int) -> torch.Tensor:
    """The index of the first True of `rejected` [k], or k (a 0-d device tensor; argmax finds the first)."""
    return torch.where(rejected.any(), torch.argmax(rejected.int()), k)


@dataclass
class Verdict:
    """A round's verdict on the device as float64 (exact for token ids): [drafts kept, the token after them, the
    k drafts], then the rider's values."""
    values: torch.Tensor
    k: int

    def read(self, values: list[float]) -> tuple[int, int, list[int], list[float]]:
        """(drafts kept, the token after them, the drafts, the rider's values) from `values` read to the host."""
        m = self.k + 2
        head = [int(v) for v in values[:m]]
        return head[0], head[1], head[2:], values[m:]
