"""The sampled verdict of a speculative round over each row's top-k candidates, and the plain sampled pick (a
verdict with no drafts): exact, with no host read, even where a tie at a row's top-k bound reaches past its
candidates.

torch's way (`Sampler._sampled_verdict`'s reference, `engine.runtime.sampler.verdict_reference`) filters the rows'
candidates (temperature, top-k, top-p, min-p), tests each draft against its row's probability, and draws the
token after the kept drafts, in ~80 small launches, so the device idles on the host's launches for a noticeable
part of a round. Here one program holds the k + 1 rows' candidates (a few dozen each)
in registers and does all of it, with the same rules, in the same order, on the same random numbers (drawn by
the caller: uniforms for the tests, an exponential race for the draw).

The candidates are each row's c largest logits (c >= 2 x top-k). A token beyond them is kept by top-k only when
it ties at the bound (the top-k-th value); real logits almost never do, but then such tokens must count. So a
first launch (`tie_group_kernel`, one program per row, which returns at once unless the row's lowest candidate
reaches its bound) counts them (m) and notes whether the row's draft is one of them; the verdict then treats
them as one group, each member as likely as a token at the bound: the group adds m x e(bound) to the row's mass,
is kept or dropped with the bound, gives a draft among it its member's probability, and races in the draw as its
members' best (the least of m' Exp(1) draws is an Exp(1) draw over m'), a rejected draft left out; the member
drawn is uniform among them (the tie kernel's pick).
"""
from __future__ import annotations

import torch

_kernel = None


def _build():
    import triton
    import triton.language as tl

    @triton.jit
    def tie_group_kernel(l_ptr, vals_ptr, ids_ptr, drafts_ptr, race_ptr, out_ptr, k, V, c, top, temperature,
                         BLOCK: tl.constexpr, COLS: tl.constexpr):
        """Row program_id(0)'s tokens tied at its top-k bound beyond its candidates: how many (m), whether the
        row's draft is one of them, and the j-th of the others in id order for j uniform (from race[c + 1], an
        Exp(1) draw: exp(-E) is uniform; one draw serves every row, as only one row's member is ever used). The
        vocabulary is scanned only where the row's lowest candidate reaches the bound: once to count the tokens
        at the bound (the candidates among them are known, so m is a difference), once to count them block by
        block up to the block that holds the member, the only one whose tokens are matched against the ids."""
        r = tl.program_id(0)
        l_ptr += r.to(tl.int64) * V
        vals_ptr += r * c
        ids_ptr += r * c
        d = tl.load(drafts_ptr + r, mask=r < k, other=-1)
        at_bound = tl.load(vals_ptr + top - 1) / temperature
        m = tl.full((), 0, tl.int32)
        drafted = tl.full((), 0, tl.int32)
        member = tl.full((), 0, tl.int64)
        if tl.load(vals_ptr + c - 1) / temperature >= at_bound:
            j = tl.arange(0, COLS)
            cand = tl.load(ids_ptr + j, mask=j < c, other=-1)
            # the candidates at the bound (all of them from column top - 1 on): the scan counts them too
            cand_tied = (j < c) & (tl.load(vals_ptr + j, mask=j < c, other=float("-inf")) / temperature >= at_bound)
            for start in range(0, V, BLOCK):
                idx = start + tl.arange(0, BLOCK)
                x = tl.load(l_ptr + idx, mask=idx < V, other=float("-inf")) / temperature
                m += tl.sum((x >= at_bound).to(tl.int32), 0)
            m -= tl.sum(cand_tied.to(tl.int32), 0)
            x_d = tl.load(l_ptr + d, mask=d >= 0, other=float("-inf")) / temperature
            drafted = ((x_d >= at_bound) & (tl.sum((cand == d).to(tl.int32), 0) == 0)).to(tl.int32)
            others = m - drafted
            pick = tl.minimum((tl.exp(-tl.load(race_ptr + c + 1)) * others).to(tl.int32), others - 1)
            seen = tl.full((), 0, tl.int32)
            for start in range(0, V, BLOCK):
                idx = start + tl.arange(0, BLOCK)
                x = tl.load(l_ptr + idx, mask=idx < V, other=float("-inf")) / temperature
                here = cand_tied & (cand >= start) & (cand < start + BLOCK)
                draft_here = (drafted > 0) & (d >= start) & (d < start + BLOCK)
                not_members = tl.sum(here.to(tl.int32), 0) + draft_here.to(tl.int32)
                members = tl.sum((x >= at_bound).to(tl.int32), 0) - not_members
                if (seen <= pick) & (pick < seen + members):
                    inside = idx == d
                    for i in range(0, c):  # one id at a time: a [BLOCK, c] compare would spill
                        inside |= idx == tl.load(ids_ptr + i)
                    tied = (x >= at_bound) & ~inside
                    rank = seen + tl.cumsum(tied.to(tl.int32), 0) - 1  # each member's place among them
                    member = tl.sum(tl.where(tied & (rank == pick), idx, 0).to(tl.int64), 0)
                seen += members
        tl.store(out_ptr + 3 * r, m.to(tl.int64))
        tl.store(out_ptr + 3 * r + 1, member)
        tl.store(out_ptr + 3 * r + 2, drafted.to(tl.int64))

    @triton.jit
    def sampled_verdict_kernel(x_ptr, ids_ptr, drafts_ptr, u_ptr, race_ptr, group_ptr, out_ptr, k, c, top,
                               temperature, top_p, min_p, ROWS: tl.constexpr, COLS: tl.constexpr, TOP_P: tl.constexpr,
                               MIN_P: tl.constexpr):
        r = tl.arange(0, ROWS)
        j = tl.arange(0, COLS)
        real = r < k + 1
        ok = real[:, None] & (j[None, :] < c)
        x = tl.load(x_ptr + r[:, None] * c + j[None, :], mask=ok, other=float("-inf")) / temperature
        # each row's candidates come sorted: the first is its largest, column top - 1 the top-k bound
        first = tl.where(real, tl.max(x, 1), 0.0)
        bound = tl.sum(tl.where(j[None, :] == top - 1, x, 0.0), 1)
        e = tl.exp(x - first[:, None])  # the unnormalised probabilities: the top token's is 1
        keep = ok & (x >= bound[:, None])
        # the tied group beyond the candidates (`tie_group_kernel`): m tokens, each with the bound's e
        m = tl.load(group_ptr + 3 * r, mask=real, other=0).to(tl.float32)
        e_bound = tl.where(real, tl.exp(bound - first), 0.0)
        group = m * e_bound
        if TOP_P:
            z = tl.sum(tl.where(keep, e, 0.0), 1) + group
            p = tl.where(j[None, :] < top, e / tl.where(z > 0, z, 1.0)[:, None], 0.0)
            ahead = tl.cumsum(p, 1) - p  # the mass before each ranked token
            last = tl.sum(((j[None, :] < top) & (ahead < top_p)).to(tl.int32), 1) - 1
            kept_from = tl.sum(tl.where(j[None, :] == last[:, None], x, 0.0), 1)
            keep = keep & (x >= kept_from[:, None])
            group = tl.where(bound >= kept_from, group, 0.0)
        if MIN_P:
            keep = keep & (e >= min_p)
            group = tl.where(e_bound >= min_p, group, 0.0)
        e = tl.where(keep, e, 0.0)
        total = tl.sum(e, 1) + group
        total = tl.where(total > 0, total, 1.0)
        probs = e / total[:, None]
        member_p = tl.where(group > 0, e_bound / total, 0.0)  # one group member's probability
        # each draft's column among its row's candidates (ids are distinct within a row), or its group member
        drafted = r < k
        d = tl.load(drafts_ptr + r, mask=drafted, other=-1)
        ids = tl.load(ids_ptr + r[:, None] * c + j[None, :], mask=ok, other=-1)
        hit = (ids == d[:, None]) & drafted[:, None]
        in_group = tl.load(group_ptr + 3 * r + 2, mask=drafted, other=0) > 0
        u = tl.load(u_ptr + r, mask=drafted, other=0.0)
        rejected = drafted & (u >= tl.sum(tl.where(hit, probs, 0.0), 1) + tl.where(in_group, member_p, 0.0))
        n = tl.min(tl.where(rejected, r, k), 0)
        # the row after the kept drafts: p without its rejected draft, or p itself after the last draft
        at_n = r[:, None] == n
        row = tl.sum(tl.where(at_n & ~hit, probs, 0.0), 0)
        race = tl.load(race_ptr + j, mask=j < c, other=1.0)
        scores = row / tl.maximum(race, 1.1754943508222875e-38)
        pick = tl.argmax(scores, 0, tie_break_left=True)
        token = tl.sum(tl.sum(tl.where(at_n & (j[None, :] == pick), ids, 0), 1), 0)
        # the group races as its members' best, the rejected draft left out: the least of m' Exp(1) draws is an
        # Exp(1) draw over m'
        others = tl.where(in_group & (r == n), m - 1.0, m)
        mass = tl.sum(tl.where(r == n, member_p * others, 0.0), 0)
        if mass / tl.maximum(tl.load(race_ptr + c), 1.1754943508222875e-38) > tl.max(scores, 0):
            token = tl.load(group_ptr + 3 * n + 1)
        tl.store(out_ptr, n.to(tl.int64))
        tl.store(out_ptr + 1, token)
        tl.store(out_ptr + 2 + r, d, mask=drafted)

    return sampled_verdict_kernel, tie_group_kernel


# the tie scan's block: each of its 8 warps' threads holds 16 logits
TIE_BLOCK = 4096


def tie_group(logits: torch.Tensor, values: torch.Tensor, ids: torch.Tensor, drafts: torch.Tensor, race: torch.Tensor,
              k: int, temperature: float, top_k: int, block: int = TIE_BLOCK) -> torch.Tensor:
    """Each row's tokens tied at its top-k bound beyond its candidates (`tie_group_kernel`): [rows, 3] (long):
    how many (m), the member drawn (uniform by race[c + 1] among them, the row's draft left out; 0 where none),
    whether the row's draft (rows < k) is one of them. `block`: the scan's block (a power of two)."""
    import triton

    rows, c = values.shape
    group = torch.empty(rows, 3, dtype=torch.long, device=values.device)
    _kernels()[1][(rows,)](logits, values, ids, drafts, race, group, k, logits.shape[-1], c, top_k, temperature,
                           BLOCK=block, COLS=triton.next_power_of_2(c), num_warps=8)
    return group


def sampled_verdict(logits: torch.Tensor, values: torch.Tensor, ids: torch.Tensor, drafts: torch.Tensor | None,
                    u: torch.Tensor | None, race: torch.Tensor, temperature: float, top_k: int, top_p: float,
                    min_p: float) -> torch.Tensor:
    """logits [k + 1, vocab] (fp32; read only where a tie at a row's top-k bound reaches past its candidates),
    values [k + 1, c] (each row's c largest logits, largest first), ids [k + 1, c] (their token ids), drafts [k]
    (long; None for a plain pick, k = 0), u [k] (uniforms; None with the drafts), race [c + 2] (Exp(1) draws) ->
    [k + 2] (long): drafts kept, the token after them, the drafts. The same law as the verdict over the whole
    vocabulary."""
    import triton

    rows, c = values.shape
    k = 0 if drafts is None else drafts.shape[0]
    values, ids = values.contiguous(), ids.contiguous()
    out = torch.empty(k + 2, dtype=torch.long, device=values.device)
    if drafts is None:  # nothing of them is read: `out` stands for the absent drafts and uniforms
        drafts = u = out
    group = tie_group(logits, values, ids, drafts, race, k, temperature, top_k)
    _kernels()[0][(1,)](values, ids, drafts, u, race, group, out, k, c, top_k, temperature, top_p, min_p,
                        ROWS=triton.next_power_of_2(rows), COLS=triton.next_power_of_2(c), TOP_P=top_p < 1.0,
                        MIN_P=min_p > 0.0, num_warps=2)
    return out


def _kernels():
    global _kernel
    if _kernel is None:
        _kernel = _build()
    return _kernel
