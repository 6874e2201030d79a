"""Logprobs and n > 1 in the engine, on the tiny random model in fp32 on the CPU: each output token's logprob
(and its top tokens') is the log-softmax of the model's logits at its place, checked against an independent
forward of the whole sequence, with and without drafts (n-gram, the controlled drafter); n choices prefill the
prompt once, each equal to a single request with its own seed, and give back every slot and block."""
import pytest
import torch

from engine import Engine, EngineConfig, SamplingParams
from engine.errors import UserError

# a repeating prompt: the n-gram drafter finds its continuations, so verify steps accept drafts
PROMPT = [7, 8, 9, 10, 11, 12] * 6


def make(**settings) -> Engine:
    settings = {"max_concurrency": 4, **settings}
    return Engine(EngineConfig("synthetic:tiny", device="cpu", dtype="float32", max_context=256, held_sequences=0,
                               **settings))


@pytest.fixture(scope="module")
def plain() -> Engine:
    return make()


def reference(eng: Engine, ids: list[int]) -> torch.Tensor:
    """log_softmax of the logits at every position of `ids`, from one forward over a fresh cache."""
    cache = eng.model.new_cache(len(ids))
    try:
        with torch.inference_mode():
            return torch.log_softmax(eng.model.forward(torch.tensor(ids), cache, all_logits=True).float(), -1)
    finally:
        cache.release()


def check_logprobs(eng: Engine, final, top: int) -> None:
    ref = reference(eng, PROMPT + final.token_ids)
    assert len(final.logprobs) == len(final.token_ids) > 0
    for i, (token, lp) in enumerate(zip(final.token_ids, final.logprobs, strict=True)):
        row = ref[len(PROMPT) - 1 + i]
        assert lp.logprob == pytest.approx(row[token].item(), abs=1e-4)
        values, ids = torch.topk(row, top)
        assert [t for t, _ in lp.top] == ids.tolist() or top == 0
        assert [v for _, v in lp.top] == pytest.approx(values.tolist(), abs=1e-4)


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_logprobs_are_the_log_softmax_of_the_raw_logits(plain, temperature):
    final = plain.complete(PROMPT, SamplingParams(max_tokens=10, temperature=temperature, seed=3, logprobs=5,
                                                  ignore_eos=True, repetition_penalty=1.3))
    check_logprobs(plain, final, 5)  # raw: before the penalty and temperature


@pytest.mark.parametrize(("settings", "counted"), [({"spec": "ngram", "draft_tokens": 4}, "drafted_tokens"),
                                                   ({"spec": "ngram", "draft_tokens": 3, "draft_acceptance": 0.6},
                                                    "accepted_tokens")])
def test_logprobs_with_drafts_come_from_the_verify_rows(settings, counted):
    eng = make(adaptive_drafts=False, **settings)  # every round drafts, whatever a busy machine's step times say
    params = SamplingParams(max_tokens=40, temperature=0, logprobs=2, ignore_eos=True)
    eng.complete(PROMPT, params)  # the controlled drafter learns the target's output from a first run
    final = eng.complete(PROMPT, params)
    # verify steps ran (the random model's own output repeats nothing, so n-gram drafts are refused) and, with
    # the controlled drafter, accepted drafts: their logprobs come from the verify rows
    assert eng.stats()[counted] > 0
    check_logprobs(eng, final, 2)
    sampled = eng.complete(PROMPT, SamplingParams(max_tokens=16, temperature=0.7, seed=1, logprobs=0,
                                                  ignore_eos=True))
    check_logprobs(eng, sampled, 0)
    eng.close()


def test_top_logprobs_are_bounded():
    with pytest.raises(UserError, match="top logprobs must be in 0..20"):
        SamplingParams(logprobs=21)


def _at_rest(eng: Engine) -> tuple:
    s = eng.stats()
    return s["running"], s["pending"], s["kv_tokens_free"], eng._reserved


def test_n_choices_prefill_once_and_match_single_requests_with_their_seeds(plain):
    start, prefilled = _at_rest(plain), plain.stats()["prefill_tokens"]
    params = SamplingParams(max_tokens=8, temperature=1.0, seed=11, ignore_eos=True, logprobs=1)
    finals = [list(s)[-1] for s in plain.submit_choices(PROMPT, params, 3)]
    assert plain.stats()["prefill_tokens"] - prefilled == len(PROMPT)  # the prompt ran once for the three
    assert [f.cached_tokens for f in finals] == [0, len(PROMPT), len(PROMPT)]
    assert _at_rest(plain) == start
    alone = [plain.complete(PROMPT, SamplingParams(max_tokens=8, temperature=1.0, seed=11 + i, ignore_eos=True))
             for i in range(3)]
    assert [f.token_ids for f in finals] == [f.token_ids for f in alone]
    assert len({tuple(f.token_ids) for f in finals}) == 3
    for f in finals:
        check_logprobs(plain, f, 1)


def test_greedy_choices_are_identical_and_cancelled_ones_give_everything_back(plain):
    start = _at_rest(plain)
    finals = [list(s)[-1] for s in plain.submit_choices(PROMPT, SamplingParams(max_tokens=6, temperature=0), 3)]
    assert finals[0].token_ids == finals[1].token_ids == finals[2].token_ids
    streams = plain.submit_choices(PROMPT, SamplingParams(max_tokens=200, temperature=0, ignore_eos=True), 3)
    for s in streams:
        next(iter(s))  # every choice runs
    for s in streams:
        s.cancel()
    assert [list(s)[-1].finish_reason for s in streams] == ["cancelled"] * 3
    early = plain.submit_choices(PROMPT, SamplingParams(max_tokens=5, temperature=0), 3)
    for s in early:  # cancelled before the prefill ends: the further choices never run
        s.cancel()
    assert {list(s)[-1].finish_reason for s in early} <= {"cancelled", "length", "stop"}
    assert _at_rest(plain) == start
    with pytest.raises(UserError, match="1..16 choices"):
        plain.submit_choices(PROMPT, SamplingParams(), 17)


def test_further_choices_copy_the_first_ones_matcher_and_checkpoints(plain, monkeypatch):
    """The further choices start from the first one's place in its grammar (a copy of its matcher, not the grammar
    built again) and with its checkpoint of the prompt's end (not one more copy of the same state each)."""
    import re

    from engine.cache.state_slots import GDNState
    from engine.runtime.request import Grammar

    built, snapshots = [], []
    matcher, snapshot = plain.grammars.matcher, GDNState.snapshot
    monkeypatch.setattr(plain.grammars, "matcher", lambda g: built.append(g) or matcher(g))
    monkeypatch.setattr(GDNState, "snapshot", lambda state, host=False: snapshots.append(host) or snapshot(state, host))
    params = SamplingParams(max_tokens=6, temperature=0, grammar=Grammar("regex", "[a-z]{1,12}"))
    finals = [list(s)[-1] for s in plain.submit_choices(PROMPT, params, 3)]
    assert len(built) == 1 and len(snapshots) == 1
    assert finals[0].text == finals[1].text == finals[2].text and re.fullmatch("[a-z]{6}", finals[0].text)
    assert [f.cached_tokens for f in finals] == [0, len(PROMPT), len(PROMPT)]  # the choices did fork


def test_choices_that_find_no_room_prefill_alone():
    eng = make(max_concurrency=1)  # one runs at a time: the further choices wait and prefill themselves
    finals = [list(s)[-1] for s in eng.submit_choices(PROMPT, SamplingParams(max_tokens=4, temperature=0), 2)]
    assert finals[0].token_ids == finals[1].token_ids
    assert eng.stats()["prefill_tokens"] == 2 * len(PROMPT)
    assert _at_rest(eng)[:2] == (0, 0)
