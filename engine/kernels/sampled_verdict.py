"""The sampled verdict of a speculative round over each row's top-k candidates, in one launch.

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

    @triton.jit
    def sampled_verdict_kernel(x_ptr, ids_ptr, drafts_ptr, u_ptr, race_ptr, out_ptr, k, c, top, temperature,
                               top_p, min_p, ROWS: tl.constexpr, COLS: tl.constexpr, TOP_P: tl.constexpr,
                               MIN_P: tl.constexpr, CHECK_MISSED: tl.constexpr):
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
        if TOP_P:
            z = tl.sum(tl.where(keep, e, 0.0), 1)
            p = tl.where(j[None, :] < top, e / tl.where(z > 0, z, 1.0)[:, None], 0.0)
            ahead = tl.cumsum(p, 1) - p  # the mass before each ranked token
            last = tl.sum(((j[None, :] < top) & (ahead < top_p)).to(tl.int32), 1) - 1
            keep = keep & (x >= tl.sum(tl.where(j[None, :] == last[:, None], x, 0.0), 1)[:, None])
        if MIN_P:
            keep = keep & (e >= min_p)
        e = tl.where(keep, e, 0.0)
        total = tl.sum(e, 1)
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
        pick = tl.argmax(row / tl.maximum(race, 1.1754943508222875e-38), 0, tie_break_left=True)
        token = tl.sum(tl.sum(tl.where(at_n & (j[None, :] == pick), ids, 0), 1), 0)
        tl.store(out_ptr, n.to(tl.int64))
        tl.store(out_ptr + 1, token)
        tl.store(out_ptr + 2 + r, d, mask=drafted)
        if CHECK_MISSED:  # a tie at the top-k bound may reach past the candidates
            lowest = tl.sum(tl.where(j[None, :] == c - 1, v, 0.0), 1)
            at_bound = tl.sum(tl.where(j[None, :] == top - 1, v, 0.0), 1)
            tl.store(out_ptr + 2 + k, tl.max((real & (lowest >= at_bound)).to(tl.int64), 0))
        else:
            tl.store(out_ptr + 2 + k, tl.full((), 0, tl.int64))

    return sampled_verdict_kernel


def sampled_verdict(values: torch.Tensor, ids: torch.Tensor, drafts: torch.Tensor, u: torch.Tensor,
                    race: torch.Tensor, temperature: float, top_k: int, top_p: float, min_p: float,
                    check_missed: bool) -> torch.Tensor:
    """values [k + 1, c] (fp32, each row's c largest logits, largest first), ids [k + 1, c] (their token ids),
    drafts [k] (long), u [k] (uniforms), race [c] (Exp(1) draws) -> [k + 3] (long): drafts kept, the token after
    them, the drafts, 1 if a tie at the top-k bound may reach past the candidates (`check_missed`) else 0."""
    import triton

    global _kernel
    if _kernel is None:
        _kernel = _build()
    rows, c = values.shape
    k = drafts.shape[0]
    out = torch.empty(k + 3, dtype=torch.long, device=values.device)
    _kernel[(1,)](values.contiguous(), ids.contiguous(), drafts, u, race, out, k, c, top_k, temperature, top_p,
                  min_p, ROWS=triton.next_power_of_2(rows), COLS=triton.next_power_of_2(c), TOP_P=top_p < 1.0,
                  MIN_P=min_p > 0.0, CHECK_MISSED=check_missed, num_warps=2)
    return out
