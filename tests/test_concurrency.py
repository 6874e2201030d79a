"""Concurrent requests without CUDA graphs (the CPU path): each request has a cache of its own, their model calls
interleave step by step, and the plain decode steps of several sequences run as one batched step. Outputs equal
those of the same requests run one after another; a short request does not wait for a long one."""
import threading

import pytest
import torch

from engine import Engine, EngineConfig, SamplingParams
from engine.runtime.batcher import StepBatcher

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
    assert eng.steps.largest_batch >= 2


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


def test_requests_that_would_overfill_the_kv_pool_wait_for_each_other(default_model_path):
    # a pool of 256 tokens (4 blocks): two requests of ~110 fit together, a third waits until one of them finishes
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
    assert max(need) < peak[0] <= 256 < sum(need)  # two ran together (2 blocks of 64 each), never all three
    assert eng.stats()["kv_tokens_in_use"] == 0


class _FailingBatch:
    """A model whose batched step fails: every sequence of that step must see the failure."""

    device, spec = torch.device("cpu"), None

    def forward(self, ids, cache, *args):
        return torch.zeros(1, 4)

    def forward_batch(self, ids, caches):
        raise RuntimeError("out of memory in the batched step")


def test_a_failed_batched_step_reaches_every_sequence_in_it():
    steps = StepBatcher(_FailingBatch())
    errors: list = []

    def call() -> None:
        try:
            steps.forward(torch.tensor([1]), object())
        except RuntimeError as e:
            errors.append(str(e))

    with steps._model_lock:  # hold the model so both steps queue, then let one run them together
        threads = [threading.Thread(target=call) for _ in range(2)]
        for t in threads:
            t.start()
        while len(steps._queued) < 2:
            threading.Event().wait(0.01)
    for t in threads:
        t.join(10)
    assert errors == ["out of memory in the batched step"] * 2
