"""The sampled verdict of a speculative round over each row's top-k candidates, in one launch; and the plain
sampled pick (no drafts) the same way, exact even where a tie at the top-k bound reaches past the candidates.

torch's way (`Sampler._sampled_verdict`'s reference, `engine.runtime.sampler.verdict_reference`) filters the rows'
candidates (temperature, top-k, top-p, min-p), tests each draft against its row's probability, and draws the
token after the kept drafts, in ~80 small launches; on an H100 the device then idles on the host's launches for
~0.6 ms of a ~12 ms round (NOTES.md (22)). Here one program holds the k + 1 rows' candidates (a few dozen each)
in registers and does all of it, with the same rules, in the same order, on the same random numbers (drawn by
the caller: uniforms for the tests, an exponential race for the draw).
"""
from __future__ import annotations

import torch

_kernel = None


def _build():
    import triton
    import triton.language as tl

    global tied_outside  # a jit kernel finds the jit functions it calls among its globals

    @triton.jit
    def tied_outside(l_ptr, start, V, temperature, at_bound, cand, BLOCK: tl.constexpr):
        """Token ids start .. start + BLOCK - 1, and which of them tie at the bound without being candidates."""
        idx = start + tl.arange(0, BLOCK)
        x = tl.load(l_ptr + idx, mask=idx < V, other=float("-inf")) / temperature
        inside = tl.sum((idx[:, None] == cand[None, :]).to(tl.int32), 1) > 0
        return idx, (x >= at_bound) & ~inside

    @triton.jit
    def tie_group_kernel(l_ptr, vals_ptr, ids_ptr, race_ptr, out_ptr, V, c, top, temperature, BLOCK: tl.constexpr,
                         COLS: tl.constexpr):
        """The tokens tied at the top-k bound beyond the candidates (one row): how many (m), and the j-th of them
        in id order for j uniform in [0, m) (from race[c + 1], an Exp(1) draw: exp(-E) is uniform). The
        vocabulary is scanned only where the lowest candidate reaches the bound, which real logits almost never
        do; otherwise m = 0 at once."""
        at_bound = tl.load(vals_ptr + top - 1) / temperature
        m = tl.full((), 0, tl.int32)
        member = tl.full((), 0, tl.int64)
        if tl.load(vals_ptr + c - 1) / temperature >= at_bound:
            j = tl.arange(0, COLS)
            cand = tl.load(ids_ptr + j, mask=j < c, other=-1)
            for start in range(0, V, BLOCK):
                m += tl.sum(tied_outside(l_ptr, start, V, temperature, at_bound, cand, BLOCK)[1].to(tl.int32), 0)
            pick = tl.minimum((tl.exp(-tl.load(race_ptr + c + 1)) * m).to(tl.int32), m - 1)
            seen = tl.full((), 0, tl.int32)
            for start in range(0, V, BLOCK):
                idx, tied = tied_outside(l_ptr, start, V, temperature, at_bound, cand, BLOCK)
                rank = seen + tl.cumsum(tied.to(tl.int32), 0) - 1  # each tied token's place among them
                member += tl.sum(tl.where(tied & (rank == pick), idx, 0).to(tl.int64), 0)
                seen += tl.sum(tied.to(tl.int32), 0)
        tl.store(out_ptr, m.to(tl.int64))
        tl.store(out_ptr + 1, member)

    @triton.jit
    def sampled_verdict_kernel(x_ptr, ids_ptr, drafts_ptr, u_ptr, race_ptr, out_ptr, group_ptr, k, c, top,
                               temperature, top_p, min_p, ROWS: tl.constexpr, COLS: tl.constexpr, TOP_P: tl.constexpr,
                               MIN_P: tl.constexpr, CHECK_MISSED: tl.constexpr, GROUP: tl.constexpr):
        r = tl.arange(0, ROWS)
        j = tl.arange(0, COLS)
        real = r < k + 1
        ok = real[:, None] & (j[None, :] < c)
        v = tl.load(x_ptr + r[:, None] * c + j[None, :], mask=ok, other=float("-inf"))
        x = v / temperature
        # each row's candidates come sorted: the first is its largest, column top - 1 the top-k bound
        first = tl.where(real, tl.max(x, 1), 0.0)
        bound = tl.sum(tl.where(j[None, :] == top - 1, x, 0.0), 1)
        e = tl.exp(x - first[:, None])  # the unnormalised probabilities: the top token's is 1
        keep = ok & (x >= bound[:, None])
        # GROUP (a draw with no drafts): the m tokens tied at the bound beyond the candidates (`tie_group_kernel`),
        # each as likely as a token at the bound, kept or dropped together as one
        group = tl.zeros((ROWS,), tl.float32)
        if GROUP:
            group = tl.where(r == 0, tl.load(group_ptr).to(tl.float32) * tl.exp(bound - first), 0.0)
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
            group = tl.where(tl.exp(bound - first) >= min_p, group, 0.0)
        e = tl.where(keep, e, 0.0)
        total = tl.sum(e, 1) + group  # the race needs no normalising; the drafts' tests do (GROUP has none)
        probs = e / tl.where(total > 0, total, 1.0)[:, None]
        # each draft's column among its row's candidates (ids are distinct within a row); none: probability 0
        drafted = r < k
        d = tl.load(drafts_ptr + r, mask=drafted, other=-1)
        ids = tl.load(ids_ptr + r[:, None] * c + j[None, :], mask=ok, other=-1)
        hit = (ids == d[:, None]) & drafted[:, None]
        u = tl.load(u_ptr + r, mask=drafted, other=0.0)
        rejected = drafted & (u >= tl.sum(tl.where(hit, probs, 0.0), 1))
        n = tl.min(tl.where(rejected, r, k), 0)
        # the row after the kept drafts: p without its rejected draft, or p itself after the last draft
        at_n = r[:, None] == n
        row = tl.sum(tl.where(at_n & ~hit, probs, 0.0), 0)
        race = tl.load(race_ptr + j, mask=j < c, other=1.0)
        scores = row / tl.maximum(race, 1.1754943508222875e-38)
        pick = tl.argmax(scores, 0, tie_break_left=True)
        token = tl.sum(tl.sum(tl.where(at_n & (j[None, :] == pick), ids, 0), 1), 0)
        if GROUP:  # the group races as its members' best: m Exp(1) draws' least is an Exp(1) draw over m
            mass = tl.sum(tl.where(r == 0, group / tl.where(total > 0, total, 1.0), 0.0), 0)
            if mass / tl.maximum(tl.load(race_ptr + c), 1.1754943508222875e-38) > tl.max(scores, 0):
                token = tl.load(group_ptr + 1)
        tl.store(out_ptr, n.to(tl.int64))
        tl.store(out_ptr + 1, token)
        tl.store(out_ptr + 2 + r, d, mask=drafted)
        if CHECK_MISSED:  # a tie at the top-k bound may reach past the candidates
            lowest = tl.sum(tl.where(j[None, :] == c - 1, v, 0.0), 1)
            at_bound = tl.sum(tl.where(j[None, :] == top - 1, v, 0.0), 1)
            tl.store(out_ptr + 2 + k, tl.max((real & (lowest >= at_bound)).to(tl.int64), 0))
        else:
            tl.store(out_ptr + 2 + k, tl.full((), 0, tl.int64))

    return sampled_verdict_kernel, tie_group_kernel


def sampled_verdict(values: torch.Tensor, ids: torch.Tensor, drafts: torch.Tensor, u: torch.Tensor,
                    race: torch.Tensor, temperature: float, top_k: int, top_p: float, min_p: float,
                    check_missed: bool) -> torch.Tensor:
    """values [k + 1, c] (fp32, each row's c largest logits, largest first), ids [k + 1, c] (their token ids),
    drafts [k] (long), u [k] (uniforms), race [c] (Exp(1) draws) -> [k + 3] (long): drafts kept, the token after
    them, the drafts, 1 if a tie at the top-k bound may reach past the candidates (`check_missed`) else 0."""
    import triton

    rows, c = values.shape
    k = drafts.shape[0]
    out = torch.empty(k + 3, dtype=torch.long, device=values.device)
    _kernels()[0][(1,)](values.contiguous(), ids.contiguous(), drafts, u, race, out, out, k, c, top_k, temperature,
                        top_p, min_p, ROWS=triton.next_power_of_2(rows), COLS=triton.next_power_of_2(c),
                        TOP_P=top_p < 1.0, MIN_P=min_p > 0.0, CHECK_MISSED=check_missed, GROUP=False, num_warps=2)
    return out


def sampled_pick(logits: torch.Tensor, values: torch.Tensor, ids: torch.Tensor, race: torch.Tensor,
                 temperature: float, top_k: int, top_p: float, min_p: float) -> torch.Tensor:
    """One token drawn from logits [vocab] (fp32) under temperature, top-k, top-p and min-p, exactly as from the
    vocabulary's filtered distribution, with no host read: values [1, c] and ids [1, c] its c largest logits
    (largest first), race [c + 2] Exp(1) draws. Tokens tied at the top-k bound beyond the candidates
    join the draw as one group (two launches: the group's count and member, then the verdict with no drafts).
    Returns the token id, a 0-d long tensor."""
    import triton

    verdict, ties = _kernels()
    c = values.shape[1]
    group = torch.empty(2, dtype=torch.long, device=logits.device)
    ties[(1,)](logits, values, ids, race, group, logits.shape[-1], c, top_k, temperature, BLOCK=1024,
               COLS=triton.next_power_of_2(c), num_warps=4)
    out = torch.empty(3, dtype=torch.long, device=logits.device)  # also stands for the absent drafts and uniforms
    verdict[(1,)](values.contiguous(), ids.contiguous(), out, race, race, out, group, 0, c, top_k, temperature,
                  top_p, min_p, ROWS=1, COLS=triton.next_power_of_2(c), TOP_P=top_p < 1.0, MIN_P=min_p > 0.0,
                  CHECK_MISSED=False, GROUP=True, num_warps=2)
    return out[1]


def _kernels():
    global _kernel
    if _kernel is None:
        _kernel = _build()
    return _kernel
