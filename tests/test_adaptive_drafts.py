"""Adaptive drafts: a request's drafts follow its acceptance, a step drafts where drafting made more tokens per
second at that load, and the output stays what plain decoding gives (the choice moves K only)."""
import pytest

from engine import Engine, EngineConfig, SamplingParams
from engine.runtime.drafts import EXPLORE, MIN_REACH, Acceptance, LoadChoice, promised_tokens


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


def test_a_step_drafts_where_its_promised_tokens_beat_plain_steps_in_time():
    choice = LoadChoice()
    assert choice.drafting(1, 3.0)  # nothing measured: draft
    choice.record(1, True, 1.0)
    assert not choice.drafting(1, 3.0)  # no plain time yet: the next step measures one
    choice.record(4, True, 2.0)
    choice.record(4, False, 1.0)  # at 4 running requests a drafting step takes twice a plain one
    picks = [choice.drafting(4, 6.0) for _ in range(2 * EXPLORE)]  # 6 tokens in 2 s < 4 tokens in 1 s
    assert picks.count(True) == 2  # drafting only as the once-in-EXPLORE try of the other choice
    # the requests' acceptance rose: 10 promised tokens in 2 s beat 4 in 1 s at once, whatever was measured
    # while drafts failed
    assert [choice.drafting(4, 10.0) for _ in range(EXPLORE)].count(False) == 1
    assert promised_tokens(Acceptance(), 0) == 1.0  # no drafts: the request's own token
    fresh = promised_tokens(Acceptance(), 7)  # the prior 1/2 drafts 3: 1 + 1/2 + 1/4 + 1/8
    assert fresh == pytest.approx(1.875)


def test_the_choice_reports_what_it_compares():
    choice = LoadChoice()
    for seconds in (0.010, 0.030, 0.012):
        choice.record(8, True, seconds)
    choice.record(8, False, 0.007)
    choice.record(1, False, 0.004)
    assert choice.summary() == {"1": {"drafting_ms": None, "plain_ms": 4.0, "drafting_steps": 0, "plain_steps": 1},
                                "8": {"drafting_ms": 12.0, "plain_ms": 7.0, "drafting_steps": 3, "plain_steps": 1}}


def test_a_stalled_step_does_not_turn_drafting_off():
    """A drafting step that the OS held up (another process on the cores) counts as one of the recent steps, not as
    a new figure: the next steps still draft."""
    choice = LoadChoice()
    for _ in range(4):
        choice.record(2, True, 1.2)
        choice.record(2, False, 1.0)
    choice.record(2, True, 30.0)
    assert choice.time(2, True) == 1.2
    assert [choice.drafting(2, 3.0) for _ in range(EXPLORE)].count(True) == EXPLORE - 1  # all but the one try


def test_a_drafter_that_starts_failing_and_recovers_is_followed_within_a_request():
    """The measured pass of the benchmark drafter after a pass whose drafts all failed: drafting resumes at once
    (times do not remember the failed drafts; the request's own acceptance promises tokens again)."""
    eng = Engine(EngineConfig("synthetic:tiny", device="cpu", dtype="float32", spec="ngram", draft_tokens=7,
                              draft_acceptance=0.6, held_sequences=0))
    choice = eng.core.load_choice
    measured = choice.record  # steps timed as a machine with nothing else running times them: a drafting step 1.5
    # plain ones (a busy test machine's stalls would otherwise decide which steps draft)
    choice.record = lambda running, drafted, seconds: measured(running, drafted, 1.5 if drafted else 1.0)
    params = SamplingParams(max_tokens=64, temperature=0, ignore_eos=True)
    prompt = list(range(5, 40))
    eng.complete(prompt, params)  # the first pass: the benchmark drafter learns the output, its drafts fail
    again = eng.complete(prompt, params)
    assert again.spec.acceptance_rate > 0.4 and again.spec.rounds < 40
    seen = eng.stats()["draft_choice"]["1"]  # what /health shows: the times the choice compared, its steps
    assert seen["drafting_ms"] == 1500.0 and seen["plain_ms"] == 1000.0 and seen["drafting_steps"] > 0


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


def test_a_step_without_drafts_times_as_a_plain_step():
    """A step the load choice let draft whose requests made no drafts (here they may not) ran as a plain step, and
    its time counts as one: it would make drafting look cheaper than it is."""
    eng = Engine(EngineConfig("synthetic:tiny", device="cpu", dtype="float32", spec="ngram", draft_tokens=7))
    eng.complete([5, 6, 7, 8, 9] * 4, SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, speculate=False))
    assert eng.core.load_choice.recent and not any(drafted for _, drafted in eng.core.load_choice.recent)
