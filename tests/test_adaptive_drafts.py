"""Adaptive drafts: a request's drafts follow its acceptance, a step drafts where drafting made more tokens per
second at that load, and the output stays what plain decoding gives (the choice moves K only)."""
import pytest

from engine import Engine, EngineConfig, SamplingParams
from engine.runtime.drafts import EXPLORE, MIN_REACH, Acceptance, LoadChoice


def test_drafts_follow_acceptance():
    good, poor = Acceptance(), Acceptance()
    for _ in range(20):
        good.add(7, 7)
        poor.add(4, 0)
    assert good.drafts(7) == 7 and good.drafts(15) > 7
    assert poor.drafts(7) == 1  # a request whose drafts fail keeps one draft a round, to notice when they start
    assert poor.rate ** 2 < MIN_REACH <= poor.rate
    fresh = Acceptance()
    assert fresh.drafts(7) == 3  # the prior (1/2): 0.5 ** 3 >= 0.1 > 0.5 ** 4


def test_a_step_drafts_where_drafting_made_more_tokens_per_second():
    choice = LoadChoice()
    assert choice.drafting(1)  # nothing measured: draft
    choice.record(1, True, 5, 1.0)
    picks = [choice.drafting(1) for _ in range(3 * EXPLORE)]
    assert picks.count(False) == 3  # no plain figure yet: plain steps get their once-in-EXPLORE try
    choice.record(4, True, 8, 1.0)
    choice.record(4, False, 16, 1.0)  # at 4 running requests plain steps made twice the tokens per second
    picks = [choice.drafting(4) for _ in range(2 * EXPLORE)]
    assert picks.count(True) == 2  # drafting only as the once-in-EXPLORE try of the other choice
    for _ in range(30):  # drafting pays again (acceptance rose): the figures follow
        choice.record(4, True, 40, 1.0)
    assert [choice.drafting(4) for _ in range(EXPLORE)].count(False) == 1


@pytest.mark.parametrize("adaptive", [True, False])
def test_adaptive_drafts_keep_the_output(adaptive):
    prompt = [5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6, 7]
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    plain = Engine(EngineConfig("synthetic:tiny", device="cpu", dtype="float32")).complete(prompt, params)
    eng = Engine(EngineConfig("synthetic:tiny", device="cpu", dtype="float32", spec="ngram", draft_tokens=7,
                              adaptive_drafts=adaptive))
    final = eng.complete(prompt, params)
    assert final.token_ids == plain.token_ids
    assert final.spec.rounds > 0 and (eng.core.load_choice is not None) == adaptive
