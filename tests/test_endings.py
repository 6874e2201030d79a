"""Every way a generation ends gives what the cache holds afterwards: the output tokens that were fed (each but
the last, which nothing fed; with a stop token, every one), kept as a held conversation that serves the next
turn with the same tokens as a fresh prefill."""
import pytest
import torch

from engine import Engine, EngineConfig, SamplingParams

from .conftest import admitted_together

PROMPT = torch.randint(0, 256, (30,), generator=torch.Generator().manual_seed(21)).tolist()


@pytest.fixture(scope="module")
def eng():
    return Engine(EngineConfig("synthetic:tiny", device="cpu", dtype="float32"))


def run(eng: Engine, ids: list[int], params: SamplingParams):
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
def test_each_ending_holds_the_fed_tokens(eng, ending):
    params = endings(eng)[ending]
    final, held = run(eng, PROMPT, params)
    assert final.finish_reason == ("length" if ending in ("length", "sampled") else "stop")
    (seq,) = held.values()
    assert seq.tokens == (PROMPT + final.token_ids if ending == "stop token" else PROMPT + final.token_ids[:-1])
    assert seq.cache.length == len(seq.tokens)


def test_a_held_turn_serves_the_next_one(eng):
    params = endings(eng)["stop token"]
    first, _ = run(eng, PROMPT, params)
    assert first.finish_reason == "stop" and first.stop_token_id == params.stop_token_ids[0]
    turn = PROMPT + first.token_ids + [first.stop_token_id] + [5, 6, 7]
    greedy = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    fresh, _ = run(eng, turn, greedy)
    eng.complete(PROMPT, params)  # held again (run() dropped it)
    reused = eng.complete(turn, greedy)
    assert reused.cached_tokens == len(PROMPT) + len(first.token_ids)
    assert reused.token_ids == fresh.token_ids


def test_an_error_in_one_requests_pick_ends_that_request_alone(monkeypatch):
    """Two requests in the same steps; one's output fails at its third token (as a grammar refusing a token
    would): it ends with the error, the other runs to its end, and nothing stays running."""
    eng = Engine(EngineConfig("synthetic:tiny", device="cpu", dtype="float32", max_concurrency=2))
    from engine.runtime.sequence import Sequence

    output = Sequence.output

    def failing(seq, token, *rest):
        if seq.prompt_ids == PROMPT[:20] and len(seq.out.ids) == 2:
            raise RuntimeError("refused")
        return output(seq, token, *rest)

    monkeypatch.setattr(Sequence, "output", failing)
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    with admitted_together(eng):  # sharing steps from the first one: the bad request lives three steps
        bad, good = eng.submit(PROMPT[:20], params), eng.submit(PROMPT[5:25], params)
    with pytest.raises(RuntimeError, match="refused"):
        list(bad)
    assert list(good)[-1].finish_reason == "length"
    assert eng.core.batched_steps > 0 and eng.stats()["running"] == 0
