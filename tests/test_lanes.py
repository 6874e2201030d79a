"""Lanes (the working caches CUDA graphs are bound to): which batch bucket serves a step of a set of lanes, how
lanes are lent and returned, and how many a config gets. The graphs themselves run in tests/test_runner.py (GPU)."""
import pytest
import torch

from engine.cache.kv_cache import KVCache
from engine.cache.kv_pool import StoreSpec
from engine.cache.sequence import SequenceCache
from engine.config import EngineConfig
from engine.runtime.lanes import Lanes, batch_bucket, batch_buckets

from .conftest import gpu_only


def test_buckets_are_the_powers_of_two_below_the_lanes_and_the_lanes():
    assert batch_buckets(1) == ()
    assert batch_buckets(2) == (2,)
    assert batch_buckets(3) == (2, 3)
    assert batch_buckets(8) == (2, 4, 8)
    assert batch_buckets(6) == (2, 4, 6)


@pytest.mark.parametrize(("stepping", "busy", "want"), [
    ([0, 1], {0, 1}, 2),
    ([1, 0], {0, 1}, 2),  # any order
    ([0, 1, 2], {0, 1, 2}, 4),  # lane 3 is free: its row computes a throw-away token
    ([0, 2], {0, 2}, 4),  # lane 1 (free) between them
    ([0, 2], {0, 1, 2}, None),  # lane 1 runs (a prefill, or between steps): no bucket may step it
    ([0, 1], {0, 1, 3}, 2),  # lane 3 runs outside the bucket
    ([0, 1, 2], {0, 1, 2, 3}, None),
    ([5, 7], {5, 7}, 8),
    ([0, 9], {0, 9}, None),  # past every bucket
])
def test_batch_bucket_covers_the_stepping_lanes_and_only_free_others(stepping, busy, want):
    assert batch_bucket(stepping, busy, (2, 4, 8)) == want


def _cache() -> SequenceCache:
    return SequenceCache(KVCache.new(StoreSpec(1, 1, 4, "auto", torch.float32), 8, torch.device("cpu")))


def test_lanes_lend_the_lowest_free_one_and_none_when_all_are_lent():
    lanes = Lanes([_cache() for _ in range(3)])
    a, b, c = (lanes.take() for _ in range(3))
    assert [lanes.index(x) for x in (a, b, c)] == [0, 1, 2]
    assert lanes.index(_cache()) is None
    b.length, b.media = 5, object()  # a request with images ran in it
    lanes.give(b)
    assert b.length == 0 and lanes.busy() == {0, 2}  # a free lane's throw-away token lands at position 0
    assert b.media is None  # its images' embeddings do not stay on the device with the free lane
    assert lanes.take() is b
    assert lanes.take() is None  # all three lent
    lanes.give(c)
    assert lanes.take() is c


def test_lanes_per_config():
    assert EngineConfig("m").graph_lanes == 1
    assert EngineConfig("m", max_concurrency=8, max_context=8192).graph_lanes == 8
    # lanes hold no KV of their own: the pool's blocks go to whichever requests run
    assert EngineConfig("m", max_concurrency=8, max_context=8192, kv_capacity=32768).graph_lanes == 8
    assert EngineConfig("m", max_concurrency=8, spec="ngram").graph_lanes == 8  # each lane keeps drafter graphs


class _Replayed:
    """A CUDA graph's contract on the CPU: a replay runs the captured call again, reading the same static input
    buffers, and writes its result into the captured output."""

    def __init__(self, fn, out: torch.Tensor) -> None:
        self.fn, self.out = fn, out

    def replay(self) -> None:
        with torch.inference_mode():
            self.out.copy_(self.fn())


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=gpu_only)])
def test_batch_buckets_and_lane_graphs_give_each_sequence_its_own_logits(monkeypatch, device):
    """The runner's bookkeeping (which graph, the ids and positions of each row, the lengths after), with real
    graphs on a GPU and emulated ones on the CPU: a step of lanes 0 and 2 (lane 1 free) replays bucket 4, and
    with lane 1 running but not stepping it falls back to each lane's own graph; the logits and caches match
    the model stepping each sequence alone."""
    from engine import Engine
    from engine.runtime import runner as runner_module

    if device == "cpu":
        monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: None)
        monkeypatch.setattr(runner_module, "capture_graph",
                            lambda fn, pool: (lambda out: (_Replayed(fn, out), out))(fn()))
    eng = Engine(EngineConfig("synthetic:tiny", device=device, dtype="float32", cuda_graphs=False))
    m = eng.model
    lanes = Lanes([m.new_cache(64) for _ in range(4)])
    run = runner_module.GraphRunner(m, lanes, (1,))
    run.capture_all()
    assert run.captured == (1,) and run.captured_batches == (2, 4)
    held = [lanes.take() for _ in range(3)]
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, 256, (n,), generator=g).to(device) for n in (6, 11, 8)]
    alone = [m.new_cache(64) for _ in prompts]
    with torch.inference_mode():
        for p, lane, own in zip(prompts, held, alone, strict=True):
            run.forward(p, lane)
            m.forward(p, own)
        lanes.give(held[1])  # lane 1 is free: bucket 4 serves lanes 0 and 2
        for busy_middle in (False, True):
            if busy_middle:
                assert lanes.take() is held[1]
                run.forward(prompts[1], held[1])  # running, but not in the step: each lane's own graph
            nxt = torch.randint(0, 256, (2,), generator=g).to(device)
            replays = run.batch_replays
            got = run.forward_batch(nxt, [held[2], held[0]])
            want = torch.cat([m.forward(nxt[:1], alone[2]), m.forward(nxt[1:], alone[0])])
            assert run.batch_replays == replays + (not busy_middle)
            assert ((got - want).norm() / want.norm()).item() < 1e-5
            assert [held[0].length, held[2].length] == [alone[0].length, alone[2].length]
