"""Sampling: seeded determinism and that each filter restricts the support as defined."""
import pytest
import torch

from engine import SamplingParams, UserError
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


@pytest.mark.parametrize("kwargs", [{"max_tokens": 0}, {"max_tokens": -3}, {"top_p": 0.0}, {"temperature": -1},
                                    {"min_p": 1.0}, {"top_k": -1}])
def test_bad_params_rejected(kwargs):
    with pytest.raises(UserError):
        SamplingParams(**kwargs)


def test_seeded_generation_is_reproducible(default_engine):
    ids = default_engine.tokenizer.encode("Once upon a time")
    params = SamplingParams(max_tokens=24, temperature=0.9, top_p=0.9, seed=42, ignore_eos=True)
    assert default_engine.complete(ids, params).token_ids == default_engine.complete(ids, params).token_ids
