"""Concurrent requests without CUDA graphs (the CPU path): each request has a cache of its own, and the engine core
runs the rows of all of them (prefill chunks, decode tokens, verify steps) as one batched step. Outputs equal those
of the same requests run one after another; a short request does not wait for a long one; a failed step fails its
requests alone and gives back what they held."""
import threading

import pytest

from engine import Engine, EngineConfig, SamplingParams

PROMPTS = ("The capital of France is", "Write a haiku about autumn leaves.", "def fibonacci(n):")


@pytest.fixture(scope="module")
def eng(default_model_path):
    return Engine(EngineConfig(default_model_path, device="cpu", max_concurrency=3, held_sequences=0))


def test_concurrent_requests_batch_their_steps_and_match_sequential_runs(eng):
    prompts = [eng.tokenizer.encode(p, add_special=True) for p in PROMPTS]
    params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    alone = [eng.complete(p, params).token_ids for p in prompts]
    before = eng.stats()["batched_steps"]
    results: list = [None] * len(prompts)
    start = threading.Barrier(len(prompts))

    def run(i: int) -> None:
        start.wait()
        results[i] = eng.complete(prompts[i], params).token_ids

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert results == alone
    assert eng.stats()["batched_steps"] > before  # steps of several sequences ran as one
    assert eng.core.largest_batch >= 2


def test_a_short_request_finishes_while_a_long_one_runs(eng):
    long_ids = eng.tokenizer.encode(PROMPTS[1], add_special=True)
    short_ids = eng.tokenizer.encode(PROMPTS[0], add_special=True)
    produced, started = [], threading.Event()

    def long_run() -> None:
        for event in eng.submit(long_ids, SamplingParams(max_tokens=200, temperature=0, ignore_eos=True)):
            if getattr(event, "token_id", None) is not None:
                produced.append(event.token_id)
                started.set()

    worker = threading.Thread(target=long_run)
    worker.start()
    assert started.wait(60)
    final = eng.complete(short_ids, SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    during = len(produced)
    worker.join(300)
    assert final.completion_tokens == 4
    assert during < 200 and len(produced) == 200  # the short one ended while the long one was still going


def test_requests_that_would_overfill_the_kv_pool_finish_within_it(default_model_path):
    # a pool of 256 tokens (4 blocks): two requests of ~125 fit together; each starts with its prompt's block and
    # a spare one reserved, so two start, and the third waits until one ends (preemption: tests/test_preemption.py)
    eng = Engine(EngineConfig(default_model_path, device="cpu", max_concurrency=3, max_context=256,
                              kv_capacity=256, held_sequences=0))
    prompts = [eng.tokenizer.encode(p, add_special=True) for p in PROMPTS]
    params = SamplingParams(max_tokens=100, temperature=0, ignore_eos=True)
    peak, done = [0], []

    def watch() -> None:
        while len(done) < len(prompts):
            peak[0] = max(peak[0], eng.stats()["kv_tokens_in_use"])
            threading.Event().wait(0.002)

    def run(i: int) -> None:
        done.append(eng.complete(prompts[i], params).completion_tokens)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))] + [threading.Thread(target=watch)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert done == [100] * 3
    need = [len(p) + 100 for p in prompts]
    assert max(need) < peak[0] <= 256 < sum(need)  # two ran together (2 blocks of 64 each), never all three whole
    assert eng.stats()["preemptions"] == 0 and eng.stats()["kv_tokens_in_use"] == 0


def test_a_failed_step_fails_its_requests_and_frees_what_they_held(eng, monkeypatch):
    prompts = [eng.tokenizer.encode(p, add_special=True) for p in PROMPTS[:2]]
    params = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)
    real, calls = eng.model.forward_rows, []

    def failing(ids, rows, *args, **kwargs):
        calls.append(len(rows))
        if len(rows) == 2 and not any(r.tokens > 1 for r in rows):  # the first step that decodes both
            raise RuntimeError("out of memory in the batched step")
        return real(ids, rows, *args, **kwargs)

    monkeypatch.setattr(eng.model, "forward_rows", failing)
    streams = [eng.submit(p, params) for p in prompts]
    errors = []
    for s in streams:
        try:
            for _ in s:
                pass
        except RuntimeError as e:
            errors.append(str(e))
    assert errors == ["out of memory in the batched step"] * 2
    stats = eng.stats()
    assert (stats["running"], stats["pending"], stats["kv_tokens_in_use"]) == (0, 0, 0)
    monkeypatch.setattr(eng.model, "forward_rows", real)
    assert eng.complete(prompts[0], params).completion_tokens == 30  # the engine goes on


def test_a_long_prompt_prefills_in_chunks_between_the_running_requests_tokens(monkeypatch):
    """While a 600-token prompt prefills in chunks of what a step's budget (64 tokens) leaves, the request that
    was already decoding gets a token in every one of those steps, its row in the same step as the chunk."""
    import torch

    eng = Engine(EngineConfig("synthetic:tiny", device="cpu", dtype="float32", max_concurrency=2, prefill_chunk=64,
                              held_sequences=0))
    g = torch.Generator().manual_seed(3)
    short, long = (torch.randint(0, 256, (n,), generator=g).tolist() for n in (8, 600))
    steps: list[list[tuple[int, bool]]] = []  # each step's rows: (their request's prompt length, prefill)
    plan = eng.core.scheduler.plan

    def recording(propose):
        works = plan(propose)
        steps.append([(len(w.seq.prompt_ids), w.prefill) for w in works])
        return works

    # the steps as the core planned them, not as the streams' readers saw their tokens arrive (a busy machine
    # delays those threads)
    monkeypatch.setattr(eng.core.scheduler, "plan", recording)
    running = eng.submit(short, SamplingParams(max_tokens=400, temperature=0, ignore_eos=True))
    events = iter(running)
    for _ in range(3):
        next(events)  # it decodes
    list(eng.submit(long, SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)))
    running.cancel()
    chunks = [rows for rows in steps if (len(long), True) in rows]
    assert len(chunks) >= 600 // 64 - 1  # the prompt's ~10 chunks
    assert all((len(short), False) in rows for rows in chunks)  # each in a step with the running request's token
