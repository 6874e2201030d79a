"""Requests admitted by what their prompts need now, not by prompt + max_tokens: where the KV pool runs out as they
decode, the engine core preempts the newest (its cache given back, kept as a held conversation where they are
kept) and resumes it later. The outputs are those of each request run alone; every block comes back."""
import json
import re
import threading
import time
from itertools import pairwise

import pytest

from engine import Engine, EngineConfig, SamplingParams
from engine.cache.kv_pool import pages
from engine.runtime.request import FinishEvent, Grammar, TokenEvent
from engine.runtime.sequence import Sequence

from .conftest import gpu_only

PROMPTS = ("The capital of France is", "Write a haiku about autumn leaves.", "def fibonacci(n):")
GREEDY = SamplingParams(max_tokens=100, temperature=0, ignore_eos=True)


def small_pool(**settings) -> Engine:
    """Three requests of ~125 tokens each need 6 blocks of 64 tokens at their ends; the pool has 4."""
    return Engine(EngineConfig("synthetic:tiny", **{"device": "cpu", "dtype": "float32", "max_concurrency": 3,
                                                    "max_context": 256, "kv_capacity": 256, **settings}))


@pytest.fixture
def exact_fit(monkeypatch):
    """Requests admitted while their prompts alone fit (no spare block reserved past them): the scenarios below
    build a full pool from prompts that fill it exactly, which the spare would keep waiting instead."""
    import engine.engine

    monkeypatch.setattr(engine.engine, "SPARE_TOKENS", 0)


def at_once(eng: Engine, prompts: list[list[int]], params: SamplingParams) -> list:
    """Each prompt's final event, all submitted before the engine's loop takes its next step."""
    return [events[-1] for events in together(eng, prompts, [params] * len(prompts))]


def together(eng: Engine, prompts: list[list[int]], params: list[SamplingParams]) -> list[list | Exception]:
    """Each request's events (or the error its stream raised), all submitted before the engine's loop takes its
    next step; a request that never ends fails the test instead of hanging it."""
    with eng.core.scheduler.lock:
        streams = [eng.submit(p, q) for p, q in zip(prompts, params, strict=True)]
    got: list = [None] * len(streams)

    def read(i: int) -> None:
        try:
            got[i] = list(streams[i])
        except Exception as exc:  # noqa: BLE001 - the test looks at it
            got[i] = exc

    threads = [threading.Thread(target=read, args=(i,), daemon=True) for i in range(len(streams))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads), "a request never ended"
    return got


def preemptions_seen(eng: Engine) -> list[tuple[Sequence, int, int]]:
    """Each preemption as it comes: the request, the tokens its cache held and those it had output."""
    seen, preempt = [], eng.core._preempt

    def spy(seq: Sequence) -> None:
        seen.append((seq, seq.cache.length, len(seq.out.ids)))
        preempt(seq)

    eng.core._preempt = spy
    return seen


def streamed_text(events: list) -> str:
    return "".join(e.text for e in events if isinstance(e, TokenEvent))


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


@pytest.mark.parametrize("settings", [{"held_sequences": 0}, {"held_sequences": 4, "host_kv_mib": 64}],
                         ids=["recomputed", "held-on-the-host"])
def test_a_preempted_request_resumes_with_room_to_go_on(settings):
    """Resumed with no block to spare, a request (the newest running) would need one for its next tokens and be
    preempted again after a few: it comes back once a block more than it holds is free."""
    eng = small_pool(**settings)
    prompts = [eng.tokenizer.encode(p, add_special=True) for p in PROMPTS]
    seen = preemptions_seen(eng)
    params = SamplingParams(max_tokens=150, temperature=0, ignore_eos=True)
    finals = at_once(eng, prompts, params)
    assert all(len(f.token_ids) == 150 for f in finals) and seen
    outputs: dict[int, list[int]] = {}
    for seq, _, output in seen:
        outputs.setdefault(id(seq), []).append(output)
    assert all(b - a >= 64 for out in outputs.values() for a, b in pairwise(out)), outputs
    assert_all_given_back(eng)


def test_requests_admitted_together_each_reserve_their_spare_block():
    """Three one-block prompts whose outputs fill a second block, in a pool of four: two start (a block and its
    spare each), the third waits for them, and none is preempted, as none would be were the spare counted once
    for all three."""
    eng = small_pool(held_sequences=0)
    prompts = [eng.tokenizer.encode(p, add_special=True) for p in PROMPTS]
    params = SamplingParams(max_tokens=80, temperature=0, ignore_eos=True)
    assert all(pages(len(p)) == 1 and pages(len(p) + 80) == 2 for p in prompts)
    alone = [eng.complete(p, params).token_ids for p in prompts]
    finals = at_once(eng, prompts, params)
    assert [f.token_ids for f in finals] == alone
    assert eng.stats()["preemptions"] == 0 and eng.core.largest_batch == 2
    assert_all_given_back(eng)


@gpu_only
@pytest.mark.parametrize("settings", [{"held_sequences": 0}, {"spec": "dflash", "drafter": "synthetic:dflash-tiny"}],
                         ids=["plain", "dflash"])
def test_preemption_in_the_graph_lanes(settings):
    """On a GPU with CUDA graphs a request runs in a lane whose graphs read its block table: a preempted one gives
    its lane back and resumes in whichever lane is free, its verify rows cut to the drafts its blocks hold."""
    eng = small_pool(device="cuda", cuda_graphs=True, **settings)
    prompts = [eng.tokenizer.encode(p, add_special=True) for p in PROMPTS]
    alone = [eng.complete(p, GREEDY).token_ids for p in prompts]
    eng.drop_held()
    finals = at_once(eng, prompts, GREEDY)
    assert [f.token_ids for f in finals] == alone
    assert eng.stats()["preemptions"] > 0 and eng.lanes.busy() == set()
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


def test_speculative_requests_are_preempted_for_the_tokens_they_feed_never_for_their_drafts():
    """A verify row whose drafts would need a block the pool cannot give runs with the drafts that fit: a request
    is preempted only where the token it must feed has no block. On random weights n-gram drafts are never
    accepted, so every step outputs one token a request and the preemptions are those of plain decoding; before,
    a resumed request was preempted again at once by its own drafts, prefilling all it had again each time."""
    plain, drafted = small_pool(held_sequences=0), small_pool(held_sequences=0, spec="ngram", draft_tokens=4,
                                                               adaptive_drafts=False)
    prompts = [plain.tokenizer.encode(p, add_special=True) for p in PROMPTS]
    alone = [plain.complete(p, GREEDY).token_ids for p in prompts]
    points = []
    for eng in (plain, drafted):
        seen = preemptions_seen(eng)
        finals = at_once(eng, prompts, GREEDY)
        assert [f.token_ids for f in finals] == alone
        points.append([(prompts.index(seq.prompt_ids), out) for seq, _, out in seen])
        assert_all_given_back(eng)
    assert points[0] and points[1] == points[0]
    assert drafted.stats()["drafted_tokens"] > 0


@pytest.mark.parametrize("settings", [{"spec": "mtp"}, {"spec": "dflash", "drafter": "synthetic:dflash-tiny"},
                                      {"spec": "dflash", "drafter": "synthetic:dflash-tiny", "held_sequences": 4,
                                       "host_kv_mib": 64}], ids=["mtp", "dflash", "dflash-held-on-the-host"])
def test_speculative_outputs_under_preemption_are_those_alone(settings):
    """Drafters with a state of their own (the MTP head's and DFlash's KV) start again on a resumed request's
    cache, prefilled again or loaded from its held copy: greedy outputs stay those of each request alone."""
    eng = small_pool(**{"held_sequences": 0, "draft_tokens": 4, "adaptive_drafts": False, **settings})
    prompts = [eng.tokenizer.encode(p, add_special=True) for p in PROMPTS]
    alone = [eng.complete(p, GREEDY).token_ids for p in prompts]
    eng.drop_held()
    finals = at_once(eng, prompts, GREEDY)
    assert [f.token_ids for f in finals] == alone
    assert eng.stats()["preemptions"] > 0 and eng.stats()["drafted_tokens"] > 0
    assert_all_given_back(eng)


@pytest.mark.parametrize("settings", [{"held_sequences": 0}, {"held_sequences": 4, "host_kv_mib": 64}],
                         ids=["recomputed", "held-on-the-host"])
def test_a_request_preempted_while_its_prompt_prefills_in_chunks(settings, exact_fit):
    """A decodes past its first block while B's long prompt prefills 16 tokens a step: B is preempted part way
    and resumes from the chunks it ran (held on the host) or prefills them again."""
    eng = small_pool(prefill_chunk=16, **settings)
    a = eng.tokenizer.encode("The capital of France is, as everyone knows, a city on a river", add_special=True)
    b = eng.tokenizer.encode("Write a haiku about autumn leaves. " * 4 + "def fib(n):", add_special=True)
    params = [SamplingParams(max_tokens=150, temperature=0, ignore_eos=True),
              SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)]
    assert (pages(len(a)), pages(len(b))) == (1, 3)  # both prompts fit the pool's 4 blocks, not A's output too
    alone = [eng.complete(p, q).token_ids for p, q in zip((a, b), params, strict=True)]
    eng.drop_held()
    prefilled, seen = eng.stats()["prefill_tokens"], preemptions_seen(eng)
    events = together(eng, [a, b], params)
    assert [e[-1].token_ids for e in events] == alone
    assert [(seq.prompt_ids, out) for seq, _, out in seen] == [(b, 0)]
    ran = seen[0][1]
    assert 0 < ran < len(b)  # part of its prompt
    again = eng.stats()["prefill_tokens"] - prefilled - len(a) - len(b)
    assert again == (0 if settings["held_sequences"] else ran)
    assert (events[1][-1].prompt_tokens, events[1][-1].cached_tokens) == (len(b), 0)  # as the caller sent it
    assert_all_given_back(eng)


def test_stop_strings_and_logprobs_go_on_across_a_preemption(exact_fit):
    """The preempted request's stop string, chosen from what it outputs after it resumes, ends it as it does
    alone: its text streamed once (no part of it again, none of the stop string), a logprob for each token."""
    eng = small_pool(held_sequences=0)
    prompts = [eng.tokenizer.encode(p, add_special=True) for p in PROMPTS]
    probe = SamplingParams(max_tokens=100, temperature=0, ignore_eos=True, logprobs=2)
    seen = preemptions_seen(eng)
    first = together(eng, prompts, [probe] * 3)
    victim, _, out = seen[0]
    i = prompts.index(victim.prompt_ids)
    text = first[i][-1].text
    start = len(streamed_text(first[i][:out + 20]))  # well after it resumed
    at = next(k for k in range(start, len(text) - 3) if "\ufffd" not in text[k:k + 3] and text.find(text[k:k + 3]) == k)
    stop = text[at:at + 3]
    params = [probe] * 3
    params[i] = SamplingParams(max_tokens=100, temperature=0, ignore_eos=True, logprobs=2, stop=(stop,))
    alone = [eng.complete(p, q) for p, q in zip(prompts, params, strict=True)]
    eng.drop_held()
    seen.clear()
    events = together(eng, prompts, params)
    assert any(seq.prompt_ids == prompts[i] for seq, _, _ in seen)
    for got, want in zip(events, alone, strict=True):
        final = got[-1]
        assert final.token_ids == want.token_ids and final.text == want.text == streamed_text(got)
        assert len(final.logprobs) == final.completion_tokens == len(want.logprobs)
        assert [e.logprob for e in got if isinstance(e, TokenEvent) and e.token_id is not None] == final.logprobs
        for x, y in zip(final.logprobs, want.logprobs, strict=True):
            assert x.logprob == pytest.approx(y.logprob, abs=1e-4)
            assert [t for t, _ in x.top] == [t for t, _ in y.top]
    final = events[i][-1]
    assert final.finish_reason == "stop" and final.stop_string == stop and final.text == text[:at]
    assert_all_given_back(eng)


def test_a_grammar_goes_on_across_a_preemption(exact_fit):
    """JSON under a schema whose strings fill more than a block: the preempted request's grammar state, kept while
    it waits, goes on where it stopped; every output is valid and the one alone."""
    eng = small_pool(held_sequences=0)
    schema = {"type": "string", "pattern": "^[a-z]{90,100}$"}
    params = SamplingParams(max_tokens=120, temperature=0, logprobs=1,
                            grammar=Grammar("json_schema", json.dumps(schema)))
    prompts = [list(b"JSON: "), list(b"Data: "), list(b"Text: ")]
    alone = [eng.complete(p, params) for p in prompts]
    finals = at_once(eng, prompts, params)
    assert eng.stats()["preemptions"] > 0
    for final, want in zip(finals, alone, strict=True):
        assert final.token_ids == want.token_ids and final.finish_reason == "stop"
        assert re.fullmatch("[a-z]{90,100}", json.loads(final.text))
        assert len(final.logprobs) == final.completion_tokens
    assert_all_given_back(eng)


def test_the_next_turn_of_a_preempted_request_reuses_what_it_held():
    """Once done, a preempted request is held as any other: its prompt and output, once (its copy held while it
    was preempted was taken back as it resumed), with the checkpoints of its prompt alone, and its next turn
    prefills only its new tokens."""
    eng = small_pool(held_sequences=4, host_kv_mib=64)
    prompts = [eng.tokenizer.encode(p, add_special=True) for p in PROMPTS]
    finals = at_once(eng, prompts, GREEDY)
    assert eng.stats()["preemptions"] > 0
    turns = [p + f.token_ids for p, f in zip(prompts, finals, strict=True)]
    assert sorted(h.tokens for h in eng.held) == sorted(t[:-1] for t in turns)  # the last token was never fed
    # the recurrent state's copies are those of any request: at its prompt's end, none where a resumed one's
    # prefill of its prompt and output so far ended
    assert sorted(list(h.checkpoints) for h in eng.held) == sorted([len(p)] for p in prompts)
    more = eng.tokenizer.encode(" And then?")
    nxt = [eng.complete(t + more, SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)) for t in turns]
    assert [n.cached_tokens for n in nxt] == [len(t) - 1 for t in turns]
    assert_all_given_back(eng)


def test_a_request_preempted_before_its_first_step_is_not_held(exact_fit):
    """A's decode needs its second block in the step that admitted B, whose prompt has run nothing yet: B is
    preempted with an empty cache, which is not worth a held conversation's place (nor its state's copy)."""
    eng = small_pool(prefill_chunk=64, held_sequences=4, host_kv_mib=64)
    a = (eng.tokenizer.encode("The capital of France is a city on the river Seine. " * 2, add_special=True))[:64]
    b = eng.tokenizer.encode("Write a haiku about autumn leaves. " * 5, add_special=True)[:150]
    params = [SamplingParams(max_tokens=100, temperature=0, ignore_eos=True),
              SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)]
    seen = preemptions_seen(eng)
    events = together(eng, [a, b], params)
    assert [(seq.prompt_ids, ran) for seq, ran, _ in seen] == [(b, 0)]
    assert [e[-1].completion_tokens for e in events] == [100, 20]
    assert sorted(len(h.tokens) for h in eng.held) == [len(a) + 99, len(b) + 19]
    assert_all_given_back(eng)


@pytest.mark.parametrize("failing", ["new_cache", "best"])
def test_a_request_that_fails_as_it_resumes_gives_back_what_it_claimed(failing, monkeypatch):
    """The first resumption fails (its cache cannot be made; looking up its held copy raises): that request ends
    with the error, what its claim took goes back (blocks and reservation), and the others finish as alone."""
    eng = small_pool(held_sequences=4, host_kv_mib=64)
    prompts = [eng.tokenizer.encode(p, add_special=True) for p in PROMPTS]
    alone = [eng.complete(p, GREEDY).token_ids for p in prompts]
    eng.drop_held()
    owner = eng.model if failing == "new_cache" else eng.held
    real, seen, failed = getattr(owner, failing), preemptions_seen(eng), []

    def fails_once_resuming(*args, **kwargs):  # first called, once a request is preempted, as one resumes
        if seen and not failed:
            failed.append(True)
            raise MemoryError("no memory for it")
        return real(*args, **kwargs)

    monkeypatch.setattr(owner, failing, fails_once_resuming)
    events = together(eng, prompts, [GREEDY] * 3)
    ended = [i for i, e in enumerate(events) if isinstance(e, Exception)]
    assert len(ended) == 1 and isinstance(events[ended[0]], MemoryError)
    assert prompts[ended[0]] in [seq.prompt_ids for seq, _, _ in seen]
    assert [e[-1].token_ids for i, e in enumerate(events) if i not in ended] == [
        t for i, t in enumerate(alone) if i not in ended]
    assert_all_given_back(eng)
    assert eng.complete(prompts[0], SamplingParams(max_tokens=200, temperature=0, ignore_eos=True)
                        ).completion_tokens == 200  # the whole pool serves one request again


def test_streamed_completions_through_the_server_under_preemption(monkeypatch):
    """Through the OpenAI SDK on the in-process app: three streamed completions admitted together, preempted in
    turn, stream the text each one gives alone, unstreamed."""
    import openai
    from fastapi.testclient import TestClient

    from engine.server.app import create_app
    from engine.server.bridge import ServerSettings

    eng = small_pool(held_sequences=0)
    args = dict(model="m", max_tokens=100, temperature=0, extra_body={"ignore_eos": True})
    with TestClient(create_app(ServerSettings(model_id="m"), lambda: eng, load_in_background=False)) as tc:
        client = openai.OpenAI(base_url="http://testserver/v1", api_key="x", http_client=tc, max_retries=0)
        alone = [client.completions.create(prompt=p, **args).choices[0].text for p in PROMPTS]
        admit = eng.core.scheduler.admit

        def once_all_queued(start):  # the loop's first admission waits for the three requests
            deadline = time.monotonic() + 30
            while len(eng.core.scheduler.waiting) < len(PROMPTS) and time.monotonic() < deadline:
                time.sleep(0.01)
            monkeypatch.setattr(eng.core.scheduler, "admit", admit)
            return admit(start)

        monkeypatch.setattr(eng.core.scheduler, "admit", once_all_queued)
        streamed: list = [None] * len(PROMPTS)

        def read(i: int) -> None:
            chunks = client.completions.create(prompt=PROMPTS[i], stream=True, **args)
            streamed[i] = "".join(c.choices[0].text for c in chunks if c.choices)

        threads = [threading.Thread(target=read, args=(i,), daemon=True) for i in range(len(PROMPTS))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
    assert streamed == alone
    assert eng.stats()["preemptions"] > 0
    assert_all_given_back(eng)
