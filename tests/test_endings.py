"""Decode steps launched before the host reads the token they feed (what a GPU does; forced here on the CPU):
the same output for every way a generation ends, and the one step too many that a stop leaves in the cache is
held with the stop token and serves the next turn."""
import pytest
import torch

from engine import Engine, EngineConfig, SamplingParams
from engine.runtime import generate as generation

PROMPT = torch.randint(0, 256, (30,), generator=torch.Generator().manual_seed(21)).tolist()


@pytest.fixture(scope="module")
def eng():
    return Engine(EngineConfig("synthetic:tiny", device="cpu", dtype="float32"))


def run(eng: Engine, ahead: bool, ids: list[int], params: SamplingParams, monkeypatch):
    monkeypatch.setattr(generation, "AHEAD_DEVICES", frozenset({"cpu"} if ahead else ()))
    eng.drop_held()
    final = eng.complete(ids, params)
    return final, eng.held._items.copy()


def endings(eng: Engine) -> dict[str, SamplingParams]:
    """Greedy params that end the output by each rule, at a token past the first."""
    seq = eng.complete(PROMPT, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
    stop = next(t for t in seq.token_ids[3:] if t not in seq.token_ids[:3])
    text = eng.tokenizer.decode(seq.token_ids[4:6])
    return {"length": SamplingParams(max_tokens=7, temperature=0, ignore_eos=True),
            "stop token": SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, stop_token_ids=(stop,)),
            "stop string": SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, stop=(text,)),
            "sampled": SamplingParams(max_tokens=9, temperature=0.9, top_p=0.9, seed=5, ignore_eos=True,
                                      repetition_penalty=1.3)}


@pytest.mark.parametrize("ending", ["length", "stop token", "stop string", "sampled"])
def test_ahead_gives_the_same_output(eng, ending, monkeypatch):
    params = endings(eng)[ending]
    now, _ = run(eng, False, PROMPT, params, monkeypatch)
    ahead, held = run(eng, True, PROMPT, params, monkeypatch)
    assert (ahead.token_ids, ahead.text, ahead.finish_reason) == (now.token_ids, now.text, now.finish_reason)
    assert ahead.finish_reason == ("length" if ending in ("length", "sampled") else "stop")
    (seq,) = held.values()
    assert seq.tokens == (PROMPT + ahead.token_ids + [ahead.stop_token_id] if ending == "stop token" else
                          PROMPT + ahead.token_ids[:-1] if ending in ("length", "sampled") else
                          PROMPT + ahead.token_ids)  # a stop string: its last token was fed ahead
    assert seq.cache.length == len(seq.tokens)


@pytest.mark.parametrize("ahead", [False, True])
def test_a_stop_token_fed_ahead_serves_the_next_turn(eng, ahead, monkeypatch):
    params = endings(eng)["stop token"]
    first, _ = run(eng, ahead, PROMPT, params, monkeypatch)
    assert first.finish_reason == "stop" and first.stop_token_id == params.stop_token_ids[0]
    turn = PROMPT + first.token_ids + [first.stop_token_id] + [5, 6, 7]
    greedy = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    fresh, _ = run(eng, ahead, turn, greedy, monkeypatch)
    eng.complete(PROMPT, params)  # held again (run() dropped it)
    reused = eng.complete(turn, greedy)
    assert reused.cached_tokens == len(PROMPT) + len(first.token_ids) + (1 if ahead else 0)
    assert reused.token_ids == fresh.token_ids
