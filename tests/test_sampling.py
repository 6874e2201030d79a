"""Sampling: seeded determinism and that each filter restricts the support as defined."""
import pytest
import torch

from engine import SamplingParams, UserError
from engine.models.rows import row_argmax, row_cumsum, row_max, row_sum, row_topk
from engine.runtime.sampler import Sampler, apply_repetition_penalty, filtered_probs

# A known distribution over 6 tokens: p = [0.4, 0.25, 0.15, 0.1, 0.06, 0.04]
P = torch.tensor([0.4, 0.25, 0.15, 0.1, 0.06, 0.04])
LOGITS = P.log()


def test_top_k_keeps_k_largest():
    probs = filtered_probs(LOGITS, SamplingParams(temperature=1.0, top_k=2))
    assert torch.allclose(probs, torch.tensor([0.4, 0.25, 0, 0, 0, 0]) / 0.65)


def test_top_p_keeps_smallest_prefix_reaching_p():
    probs = filtered_probs(LOGITS, SamplingParams(temperature=1.0, top_p=0.7))
    assert (probs > 0).tolist() == [True, True, True, False, False, False]  # 0.4+0.25 < 0.7 <= 0.8


def test_min_p_drops_below_fraction_of_max():
    probs = filtered_probs(LOGITS, SamplingParams(temperature=1.0, min_p=0.3))
    assert (probs > 0).tolist() == [True, True, True, False, False, False]  # threshold 0.12


def test_temperature_sharpens():
    cold = filtered_probs(LOGITS, SamplingParams(temperature=0.5))
    assert torch.allclose(cold, P**2 / (P**2).sum(), atol=1e-6)


def test_rows_are_filtered_each_on_its_own():
    """A verify step filters all its rows at once: each row as it would be alone (its own k-th value, top-p
    prefix and min-p threshold)."""
    rows = torch.stack([LOGITS, LOGITS.flip(0) * 2, torch.tensor([0.5, 0.5, 0.1, 0.0, -1.0, 0.3])])
    params = SamplingParams(temperature=0.9, top_k=3, top_p=0.8, min_p=0.1)
    together = filtered_probs(rows, params)
    assert torch.equal(together, torch.stack([filtered_probs(r, params) for r in rows]))
    assert (together > 0).sum(-1).tolist() == [2, 2, 3]  # each row keeps its own support


def test_empirical_frequencies_match_filtered_distribution():
    params = SamplingParams(temperature=1.0, top_k=4, seed=123)
    sampler = Sampler(params, 6, torch.device("cpu"))
    n = 20000
    counts = torch.bincount(torch.tensor([sampler(LOGITS.clone()) for _ in range(n)]), minlength=6).double()
    expected = filtered_probs(LOGITS, params).double() * n
    assert counts[4:].sum() == 0
    chi2 = (((counts[:4] - expected[:4]) ** 2) / expected[:4]).sum().item()
    assert chi2 < 16.27  # chi-square, 3 degrees of freedom, p = 0.001


def test_seed_reproducible_and_seeds_differ():
    params = SamplingParams(temperature=1.0, seed=7)
    s1, s2 = Sampler(params, 6, torch.device("cpu")), Sampler(params, 6, torch.device("cpu"))
    seq1 = [s1(LOGITS.clone()) for _ in range(200)]
    seq2 = [s2(LOGITS.clone()) for _ in range(200)]
    s3 = Sampler(SamplingParams(temperature=1.0, seed=8), 6, torch.device("cpu"))
    assert seq1 == seq2
    assert [s3(LOGITS.clone()) for _ in range(200)] != seq1


def test_repetition_penalty_rule():
    logits = torch.tensor([2.0, -2.0, 1.0])
    seen = torch.tensor([True, True, False])
    assert apply_repetition_penalty(logits, seen, 2.0).tolist() == [1.0, -4.0, 1.0]


def test_greedy_is_argmax():
    assert Sampler(SamplingParams(temperature=0), 6, torch.device("cpu"))(LOGITS.clone()) == 0


@pytest.mark.parametrize("vocab", [248320, 5000, 300])
@pytest.mark.parametrize("knobs", [{"top_k": 20, "top_p": 0.95}, {"top_k": 50}, {"top_p": 0.8},
                                   {"top_k": 40, "top_p": 0.9, "min_p": 0.05}, {"min_p": 0.1}, {}])
def test_filters_match_transformers_warpers(vocab, knobs):
    """The oracle: HF's logits warpers in HF's order (temperature, top-k, top-p, min-p), then softmax, on rows
    of random logits (their vocabulary cut into pieces or not)."""
    from transformers.generation.logits_process import (
        MinPLogitsWarper,
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
    )

    g = torch.Generator().manual_seed(vocab + len(knobs))
    logits = torch.randn(8, vocab, generator=g) * 4
    params = SamplingParams(temperature=0.7, **knobs)
    scores = TemperatureLogitsWarper(0.7)(None, logits.clone())
    for warper, key in ((TopKLogitsWarper, "top_k"), (TopPLogitsWarper, "top_p"), (MinPLogitsWarper, "min_p")):
        if key in knobs:
            scores = warper(knobs[key])(None, scores)
    want = scores.softmax(-1)
    got = filtered_probs(logits, params)
    assert torch.equal(got > 0, want > 0)
    assert (got == 0).any() == bool(knobs)  # the filters cut something (and nothing without them)
    assert torch.allclose(got, want, rtol=5e-5, atol=1e-8)  # fp32: exp of arguments down to -60 (1.4e-5 seen)


@pytest.mark.parametrize("width", [248320, 5000, 300])
def test_row_reductions_in_pieces_are_torchs(width):
    x = torch.rand(5, width, generator=torch.Generator().manual_seed(width))  # positive: cumsums grow
    assert torch.equal(row_max(x), x.amax(-1, keepdim=True))
    assert torch.equal(row_topk(x, 20), x.topk(20).values)
    assert torch.allclose(row_sum(x), x.double().sum(-1, keepdim=True).float(), rtol=1e-5)
    assert torch.allclose(row_cumsum(x), x.double().cumsum(-1).float(), rtol=1e-5)


@pytest.mark.parametrize("vocab", [248320, 5000, 1000])
def test_row_argmax_is_torchs_argmax_ties_included(vocab):
    g = torch.Generator().manual_seed(vocab)
    logits = torch.randn(8, vocab, generator=g)
    top = logits.max() + 1
    logits[1, [7, vocab - 3]] = top  # tied maxima in different pieces: the first wins
    logits[2, [vocab // 2 + 1, vocab // 2 + 2]] = top  # tied within one piece
    logits[3] = 0.5  # all tied
    got = row_argmax(logits)
    assert torch.equal(got, logits.argmax(-1))
    assert got[1] == 7 and got[3] == 0


@pytest.mark.parametrize("kwargs", [{"max_tokens": 0}, {"max_tokens": -3}, {"top_p": 0.0}, {"temperature": -1},
                                    {"min_p": 1.0}, {"top_k": -1}])
def test_bad_params_rejected(kwargs):
    with pytest.raises(UserError):
        SamplingParams(**kwargs)


def test_seeded_generation_is_reproducible(default_engine):
    ids = default_engine.tokenizer.encode("Once upon a time")
    params = SamplingParams(max_tokens=24, temperature=0.9, top_p=0.9, seed=42, ignore_eos=True)
    assert default_engine.complete(ids, params).token_ids == default_engine.complete(ids, params).token_ids
