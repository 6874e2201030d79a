"""The sampled verdict kernel (kernels/sampled_verdict.py). Against its torch reference (`verdict_reference` in
runtime/sampler.py) on the same random logits, drafts and random numbers wherever no tie at a top-k bound reaches
past the candidates: the same kept count and token, over temperature / top-k / top-p / min-p settings, every K,
drafts often the row's top token (so drafts are kept as well as rejected). Where such ties occur, by its law:
chi-square tests of the plain pick and of a round's verdict (a draft among the tied tokens beyond the candidates)
against the whole vocabulary's filtered distributions. In the Triton interpreter on the CPU at small
vocabularies, and on a GPU (NINFER_TEST_DEVICE=cuda) at the 27B's."""

import pytest

from .conftest import compile_ahead, defined, gpu_only, interpret

CHECK = """
import torch
from engine.kernels.sampled_verdict import sampled_verdict
from engine.models.rows import row_topk_ids
from engine.runtime.request import SamplingParams
from engine.runtime.sampler import CANDIDATES, verdict_reference

SETTINGS = [(0.6, 20, 0.95, 0.0), (1.0, 5, 1.0, 0.0), (0.3, 1, 1.0, 0.0), (1.5, 40, 0.5, 0.05), (0.8, 64, 0.9, 0.0),
            (1.0, 3, 1.0, 0.2)]


def check(device, vocabs, trials=6):
    g = torch.Generator().manual_seed(7)
    bad = kept = missed = total = 0
    for vocab in vocabs:
        for temperature, top_k, top_p, min_p in SETTINGS:
            if top_k >= vocab:
                continue
            params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p)
            c = min(vocab, max(CANDIDATES, 2 * top_k))
            for k in range(1, 8):
                for trial in range(trials):
                    logits = torch.randn(k + 1, vocab, generator=g) * 3
                    if trial == trials - 1 and c < vocab:  # c + 3 tokens tied at the top of one row
                        logits[k // 2, torch.randperm(vocab, generator=g)[:c + 3]] = logits.max() + 1
                    values, ids = row_topk_ids(logits, c)
                    guess = torch.randint(0, vocab, (k,), generator=g)
                    drafts = torch.where(torch.rand(k, generator=g) < 0.7, ids[:k, 0], guess)
                    u = torch.rand(k, generator=g)
                    race = torch.empty(c + 2).exponential_(generator=g)
                    want = verdict_reference(values, ids, drafts, u, race[:c], params,
                                             check_missed=c < vocab).tolist()
                    got = sampled_verdict(logits.to(device), values.to(device), ids.to(device), drafts.to(device),
                                          u.to(device), race.to(device), temperature, top_k, top_p, min_p).tolist()
                    if want[-1]:  # ties past the candidates: the reference is not the law here (the tests below)
                        missed += got[2:] == drafts.tolist() and 0 <= got[0] <= k and 0 <= got[1] < vocab
                        continue
                    bad += got != want[:-1]
                    kept, total = kept + (want[0] > 0), total + 1
    # both outcomes of the tests must occur, and ties past the candidates, or the comparison proves little
    return bad + (kept < total // 4) + (kept == total) + (missed == 0)
"""


PICK = """
import torch
from engine.runtime.request import SamplingParams
from engine.runtime.sampler import Sampler, filtered_probs


def worst_chi2(device, vocab, n):
    # Sampler.pick (no drafts) against the vocabulary's filtered distribution: bins for the five likeliest kept
    # tokens and one for the rest (<= 5 degrees of freedom); in the first case 90 tokens tie at the top-k bound,
    # past the 64 candidates, and every one of them must be drawn
    g = torch.Generator().manual_seed(12)
    tied = torch.randperm(vocab - 4, generator=g)[:90] + 4
    ties = torch.full((vocab,), -3.0)
    ties[:4] = torch.tensor([3.0, 2.5, 2.0, 1.5])
    ties[tied] = 1.0
    cases = [(ties, SamplingParams(temperature=0.8, top_k=6, top_p=0.99, seed=3)),
             (torch.randn(vocab, generator=g) * 2, SamplingParams(temperature=0.7, top_k=20, top_p=0.9, seed=4)),
             (torch.randn(vocab, generator=g) * 3, SamplingParams(temperature=1.0, top_k=10, min_p=0.1, seed=5))]
    worst = 0.0
    for logits, params in cases:
        sampler = Sampler(params, vocab, torch.device(device))
        counts = torch.zeros(vocab)
        for _ in range(n):
            counts[int(sampler.pick(logits.to(device)))] += 1
        want = filtered_probs(logits, params).double() * n
        if params.top_k == 6:
            if (counts[tied] > 0).sum() < 90:
                return float("inf")
            want = torch.cat([want[:4], want[tied].sum().view(1)])
            counts = torch.cat([counts[:4], counts[tied].sum().view(1)])
        if (counts[want == 0] > 0).any():
            return float("inf")
        order = want.argsort(descending=True)
        kept = int((want > 0).sum())
        top, rest = order[:min(5, kept - 1)], order[min(5, kept - 1):kept]
        exp = torch.cat([want[top], want[rest].sum().view(1)])
        got = torch.cat([counts[top], counts[rest].sum().view(1)])
        worst = max(worst, float(((got - exp) ** 2 / exp).sum()))
    return worst
"""


ROUND = """
import torch
from engine.models.rows import row_topk_ids
from engine.runtime.request import SamplingParams
from engine.runtime.sampler import CANDIDATES, Sampler, filtered_probs


def round_chi2(device, vocab, n):
    # Sampler.accept over two drafts against the law of the verdict over the whole vocabulary: draft 0 (row 0's
    # likeliest token) kept with probability p0(d0); draft 1 one of row 1's 90 tokens tied at its top-k bound
    # beyond its 64 candidates, kept with that member's probability p1(d1); the first rejected row draws from its
    # p without its draft (d1 never drawn there), the row after the drafts from its p. Bins: by (kept, token)
    # for the likeliest tokens, row 1's other tied tokens as one, a rest per row
    g = torch.Generator().manual_seed(21)
    params = SamplingParams(temperature=0.8, top_k=20, top_p=0.95, seed=9)
    c = max(CANDIDATES, 2 * params.top_k)
    logits = torch.randn(3, vocab, generator=g) - 3
    logits[0, 5] = 1.5
    tied = torch.randperm(vocab - 4, generator=g)[:90] + 4
    logits[1, :4] = torch.tensor([2.0, 1.8, 1.6, 1.4])
    logits[1, tied] = 1.0
    logits[2] = torch.randn(vocab, generator=g) * 2
    ids = row_topk_ids(logits[1:2], c)[1][0]
    d1 = int(next(t for t in tied if not (ids == t).any()))
    drafts = [5, d1]
    p = filtered_probs(logits, params).double()
    law = {}
    for kept, row in enumerate(p):
        reach = torch.prod(torch.tensor([p[i, drafts[i]] for i in range(kept)], dtype=torch.float64))
        rest = row.clone()
        if kept < 2:
            rest[drafts[kept]] = 0.0
        for t in rest.nonzero()[:, 0].tolist():
            law[kept, t] = float(reach * rest[t])
    assert abs(sum(law.values()) - 1) < 1e-5
    sampler = Sampler(params, vocab, torch.device(device))
    seen = {}
    x = logits.to(device)
    for _ in range(n):
        kept, token, _ = sampler.accept(x, torch.tensor(drafts, device=device))
        seen[kept, token] = seen.get((kept, token), 0) + 1
    if any(key not in law for key in seen) or (1, d1) in seen:
        return float("inf")
    group = set(tied.tolist()) - set(ids.tolist()) - {d1}

    def bin_of(key):
        kept, t = key
        if kept == 1 and t in group:
            return (1, "group")
        return key if law[key] * n >= 40 else (kept, "rest")
    want, got = {}, {}
    for key, q in law.items():
        want[bin_of(key)] = want.get(bin_of(key), 0.0) + q * n
    for key, count in seen.items():
        got[bin_of(key)] = got.get(bin_of(key), 0) + count
    if got.get((1, "group"), 0) == 0 or not any(kept == 2 for kept, _ in got):
        return float("inf")
    chi2 = sum((got.get(b, 0) - w) ** 2 / w for b, w in want.items())
    return chi2 - CRITICAL[len(want) - 1]
"""

TIES = """
import torch
from engine.kernels.sampled_verdict import TIE_BLOCK, tie_group
from engine.models.rows import row_topk_ids


def tie_reference(logits, values, ids, drafts, race, k, temperature, top):
    # per row: the tokens at the top-k bound that are not candidates (m), the draft among them, the member of
    # the others in id order at min(floor(exp(-race[c + 1]) x others), others - 1)
    c = values.shape[1]
    out = []
    for r in range(logits.shape[0]):
        bound = values[r, top - 1] / temperature
        if values[r, c - 1] / temperature < bound:
            out.append([0, 0, 0])
            continue
        tied = set((logits[r] / temperature >= bound).nonzero()[:, 0].tolist()) - set(ids[r].tolist())
        d = int(drafts[r]) if r < k else -1
        others = sorted(tied - {d})
        pick = min(int(torch.exp(-race[c + 1]) * len(others)), len(others) - 1)
        out.append([len(tied), others[pick] if others else 0, int(d in tied)])
    return out


def check_ties(device, vocab, block, trials):
    # rows 1 and 3 tie past their candidates at the top, row 2 lower down (its draft one of them), row 0 not;
    # the member drawn sweeps its range through race[c + 1], the ends included
    g = torch.Generator().manual_seed(5)
    top, c, k, temperature = 20, 64, 3, 0.7
    bad = 0
    for trial in range(trials):
        logits = torch.randn(k + 1, vocab, generator=g)
        logits[1, torch.randperm(vocab, generator=g)[:c + 40]] = 9.0
        low = torch.randperm(vocab, generator=g)[:top + 70]
        logits[2, low[:top - 1]] = 8.0 + torch.rand(top - 1, generator=g)
        logits[2, low[top - 1:]] = 7.0
        logits[3, torch.randperm(vocab, generator=g)[:c + 1]] = 9.0
        values, ids = row_topk_ids(logits, c)
        outside = [t for t in low[top - 1:].tolist() if t not in ids[2].tolist()]
        drafts = torch.tensor([int(ids[0, 0]), int(ids[1, 3]), outside[trial % len(outside)]])
        race = torch.empty(c + 2).exponential_(generator=g)
        race[c + 1] = [1e-9, 40.0][trial] if trial < 2 else race[c + 1]
        want = tie_reference(logits, values, ids, drafts, race, k, temperature, top)
        got = tie_group(logits.to(device), values.to(device), ids.to(device), drafts.to(device), race.to(device),
                        k, temperature, top, block).tolist()
        bad += got != want
    return bad
"""


def test_tie_group_kernel_in_the_interpreter():
    """The tie scan (several blocks per row) equals its torch reference: the count, the member drawn, the draft's
    membership."""
    assert interpret(TIES + "print(check_ties('cpu', 1000, 64, 6))") == 0


@gpu_only
def test_tie_group_kernel_on_the_gpu():
    namespace = defined(TIES)
    assert namespace["check_ties"]("cuda", 248320, namespace["TIE_BLOCK"], 12) == 0


# chi-square at p = 0.001 by degrees of freedom
CRITICAL = {dof: q for dof, q in enumerate([0, 10.83, 13.82, 16.27, 18.47, 20.52, 22.46, 24.32, 26.12, 27.88, 29.59,
                                             31.26, 32.91, 34.53, 36.12, 37.70, 39.25, 40.79, 42.31, 43.82, 45.31])}
ROUND += f"CRITICAL = {CRITICAL!r}\n"


@pytest.mark.slow
def test_sampled_round_with_ties_past_the_candidates_in_the_interpreter():
    """A round's verdict on the device keeps a draft that lies among tied tokens past the candidates with its
    true probability, never draws it after rejecting it, and otherwise draws as the whole vocabulary's law."""
    assert interpret(ROUND + "print(round_chi2('cpu', 300, 1000))") < 0


@gpu_only
def test_sampled_round_with_ties_past_the_candidates_on_the_gpu():
    assert defined(ROUND)["round_chi2"]("cuda", 248320, 4000) < 0


@pytest.mark.slow
def test_sampled_pick_in_the_interpreter():
    """The plain sampled pick on the device (candidates, the tied group, the verdict kernel with no drafts) draws
    from the filtered distribution of the whole vocabulary."""
    assert interpret(PICK + "print(worst_chi2('cpu', 300, 1000))") < 20.5  # chi-square, 5 dof, p = 0.001


@gpu_only
def test_sampled_pick_on_the_gpu():
    assert defined(PICK)["worst_chi2"]("cuda", 248320, 3000) < 20.5


def test_sampled_verdict_kernel_in_the_interpreter():
    assert interpret(CHECK + "print(check('cpu', [50, 3000], trials=3))") == 0


@gpu_only
def test_sampled_verdict_kernel_on_the_gpu():
    assert defined(CHECK)["check"]("cuda", [248320, 151936, 1000]) == 0


def test_sampled_verdict_kernel_compiles_for_the_users_gpus():
    from engine.kernels import sampled_verdict

    verdict, ties = sampled_verdict._build()
    sig = {"x_ptr": "*fp32", "ids_ptr": "*i64", "drafts_ptr": "*i64", "u_ptr": "*fp32", "race_ptr": "*fp32",
           "group_ptr": "*i64", "out_ptr": "*i64", "k": "i32", "c": "i32", "top": "i32", "temperature": "fp32",
           "top_p": "fp32", "min_p": "fp32"}
    for rows in (8, 1):  # a verdict, a pick
        for ptx in compile_ahead(verdict, sig, {"ROWS": rows, "COLS": 64, "TOP_P": True, "MIN_P": True}, warps=2):
            assert ".entry sampled_verdict_kernel" in ptx
    sig = {"l_ptr": "*fp32", "vals_ptr": "*fp32", "ids_ptr": "*i64", "drafts_ptr": "*i64", "race_ptr": "*fp32",
           "out_ptr": "*i64", "k": "i32", "V": "i32", "c": "i32", "top": "i32", "temperature": "fp32"}
    for ptx in compile_ahead(ties, sig, {"BLOCK": 4096, "COLS": 64}, warps=8):
        assert ".entry tie_group_kernel" in ptx
