"""Requests admitted by what their prompts need now, not by prompt + max_tokens: where the KV pool runs out as they
decode, the engine core preempts the newest (its cache given back, kept as a held conversation where they are
kept) and resumes it later. The outputs are those of each request run alone; every block comes back."""
import threading

import pytest

from engine import Engine, EngineConfig, SamplingParams
from engine.runtime.request import FinishEvent, TokenEvent

PROMPTS = ("The capital of France is", "Write a haiku about autumn leaves.", "def fibonacci(n):")
GREEDY = SamplingParams(max_tokens=100, temperature=0, ignore_eos=True)


def small_pool(**settings) -> Engine:
    """Three requests of ~125 tokens each need 6 blocks of 64 tokens at their ends; the pool has 4."""
    return Engine(EngineConfig("synthetic:tiny", device="cpu", dtype="float32", max_concurrency=3, max_context=256,
                               kv_capacity=256, **settings))


def at_once(eng: Engine, prompts: list[list[int]], params: SamplingParams) -> list:
    """Each prompt's final event, all submitted before the engine's loop takes its next step."""
    with eng.core.scheduler.lock:
        streams = [eng.submit(p, params) for p in prompts]
    finals: list = [None] * len(streams)

    def read(i: int) -> None:
        finals[i] = [e for e in streams[i] if isinstance(e, FinishEvent)][0]

    threads = [threading.Thread(target=read, args=(i,)) for i in range(len(streams))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    return finals


def assert_all_given_back(eng: Engine) -> None:
    stats = eng.stats()
    assert (stats["running"], stats["pending"]) == (0, 0)
    assert eng._reserved == 0
    eng.drop_held()
    assert eng.stats()["kv_tokens_in_use"] == 0


@pytest.mark.parametrize("settings", [{"held_sequences": 0}, {"held_sequences": 4, "host_kv_mib": 64}],
                         ids=["recomputed", "held-on-the-host"])
def test_requests_beyond_the_pool_run_together_and_the_newest_are_preempted(settings):
    eng = small_pool(**settings)
    prompts = [eng.tokenizer.encode(p, add_special=True) for p in PROMPTS]
    alone = [eng.complete(p, GREEDY).token_ids for p in prompts]
    eng.drop_held()
    prefilled = eng.stats()["prefill_tokens"]
    finals = at_once(eng, prompts, GREEDY)
    assert [f.token_ids for f in finals] == alone
    assert [f.prompt_tokens for f in finals] == [len(p) for p in prompts]  # as the caller sent them
    assert eng.stats()["preemptions"] > 0
    again = eng.stats()["prefill_tokens"] - prefilled - sum(len(p) for p in prompts)
    if settings["held_sequences"]:  # a preempted request's KV and state come back from host memory
        assert 0 < again <= eng.stats()["preemptions"]
    else:  # its prompt and output so far run again
        assert again > 64
    assert_all_given_back(eng)


def test_a_request_cancelled_while_preempted_ends_with_what_it_output():
    eng = small_pool(held_sequences=0)
    prompts = [eng.tokenizer.encode(p, add_special=True) for p in PROMPTS]
    preempt, waiting = eng.core._preempt, []

    def cancelled_once_preempted(seq) -> None:  # the first one preempted is cancelled while it waits
        preempt(seq)
        if not waiting:
            waiting.append(seq)
            seq.cancelled.set()

    eng.core._preempt = cancelled_once_preempted
    with eng.core.scheduler.lock:
        streams = [eng.submit(p, GREEDY) for p in prompts]
    events = [list(s) for s in streams]
    assert waiting, "no request was preempted"
    ended = [i for i, s in enumerate(streams) if s._seq is waiting[0]][0]
    final = events[ended][-1]
    tokens = [e.token_id for e in events[ended] if isinstance(e, TokenEvent) and e.token_id is not None]
    assert final.finish_reason == "cancelled" and 0 < final.completion_tokens == len(tokens) < 100
    assert final.token_ids == tokens
    assert all(e[-1].finish_reason == "length" for i, e in enumerate(events) if i != ended)
    assert_all_given_back(eng)


def test_a_request_for_several_choices_keeps_its_whole_reservation():
    """Its further choices start from its prefill, so it is never preempted: it is admitted only while the pool
    can hold its whole length, as before."""
    eng = small_pool(held_sequences=0)
    prompt = eng.tokenizer.encode(PROMPTS[0], add_special=True)
    streams = eng.submit_choices(prompt, SamplingParams(max_tokens=100, temperature=0, ignore_eos=True), 2)
    finals = [[e for e in s if isinstance(e, FinishEvent)][0] for s in streams]
    assert [f.completion_tokens for f in finals] == [100, 100]
    assert finals[0].token_ids == finals[1].token_ids == eng.complete(prompt, GREEDY).token_ids
    assert eng.stats()["preemptions"] == 0
    assert_all_given_back(eng)
