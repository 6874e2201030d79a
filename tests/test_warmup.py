"""The prefill warm-up at load (`engine/runtime/warmup.py`): which chunks it runs, that it runs none on the CPU,
and that everything it takes goes back (blocks, the lane, its state) with no request, held conversation or
counter seeing it: a request after it decodes as one before it, in the lane it used."""
import pytest
import torch

from engine import Engine, EngineConfig, SamplingParams
from engine.runtime import warmup
from engine.runtime.lanes import Lanes
from engine.runtime.warmup import LoadProgress, warmup_chunks

from .conftest import gpu_only


@pytest.mark.parametrize(("graphed", "chunk", "room", "want"), [
    (128, 2048, 8192, [2048, 329]),  # a full chunk, then one past the graphed size whose length is no multiple of 16
    (128, 512, 8192, [512, 329]),
    (0, 2048, 8192, [2048, 201]),  # no graphs: every chunk runs eagerly
    (128, 256, 8192, [256, 255]),
    (128, 2048, 2100, [2048]),  # no room for the second past the graphed size
    (128, 2048, 256, [256]),  # a short max_context
    (128, 129, 8192, [129]),
    (128, 128, 8192, []),  # every chunk runs as graphed pieces
    (128, 512, 100, []),
])
def test_warmup_chunks(graphed, chunk, room, want):
    got = warmup_chunks(graphed, chunk, room)
    assert got == want
    assert sum(got) <= room and all(n > graphed for n in got)
    assert len(got) < 2 or got[1] % 16


def test_load_progress_counts_the_captures_then_the_chunks():
    seen = []
    progress = LoadProgress(lambda done, total: seen.append((done, total)), 2)
    for i in range(3):
        progress.captured(i + 1, 3)
    progress.warmed(1)
    progress.warmed(2)
    assert seen == [(1, 5), (2, 5), (3, 5), (4, 5), (5, 5)]
    without = LoadProgress(None, 2)  # no report: nothing to call
    without.captured(1, 1)
    without.warmed(1)


def test_the_cpu_load_runs_no_warmup(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("warm-up on the CPU")

    monkeypatch.setattr(warmup, "warm_prefill", refuse)
    eng = Engine(EngineConfig("synthetic:tiny", device="cpu", dtype="float32"))
    stats = eng.stats()
    assert stats["prefill_tokens"] == 0 and stats["kv_tokens_in_use"] == 0 and stats["held_sequences"] == 0


def test_the_warmup_gives_everything_back():
    """The engine's warm-up on a CPU engine given a lane (as graphs give one on a GPU), with a DFlash drafter
    (taps, its KV in the pool, its observation of each chunk)."""
    eng = Engine(EngineConfig("synthetic:tiny", device="cpu", dtype="float32", spec="dflash",
                              drafter="synthetic:dflash-tiny", draft_tokens=3, max_context=512))
    prompt = torch.randint(0, 256, (40,), generator=torch.Generator().manual_seed(3)).tolist()
    params = SamplingParams(max_tokens=8, temperature=0)
    before = eng.complete(prompt, params)
    eng.drop_held()
    lane = eng.model.new_cache(eng.max_context, eng.pool)
    eng.lanes = Lanes([lane])
    # the load choice's step times: the step that ended `before` may record its time after the caller saw its end
    timed = {"draft_choice"}
    stats, free = {k: v for k, v in eng.stats().items() if k not in timed}, eng.pool.free_blocks
    chunks = warmup_chunks(16, 96, eng.max_context)
    assert chunks == [96, 95]
    seen = []
    eng._warm_prefill(chunks, seen.append)
    assert seen == [1, 2]
    assert eng.pool.free_blocks == free and eng.lanes.busy() == set()
    assert lane.length == 0 and lane.kv.table.ids == [] and lane.draft is None and lane.kept is None
    assert not lane.states.conv.any() and not lane.states.recurrent.any()
    assert {k: v for k, v in eng.stats().items() if k not in timed} == stats
    after = eng.complete(prompt, params)  # in the lane the warm-up used
    assert after.token_ids == before.token_ids and after.cached_tokens == 0


def test_a_failed_warmup_gives_everything_back(monkeypatch):
    eng = Engine(EngineConfig("synthetic:tiny", device="cpu", dtype="float32", max_context=512))
    free = eng.pool.free_blocks
    eng.lanes = Lanes([eng.model.new_cache(eng.max_context, eng.pool)])

    def fail(target, drafter, cache, chunks, progress=None):
        target.forward(torch.zeros(chunks[0], dtype=torch.long), cache)
        raise RuntimeError("a kernel failed to compile")

    monkeypatch.setattr(warmup, "warm_prefill", fail)
    with pytest.raises(RuntimeError, match="failed to compile"):
        eng._warm_prefill([96], lambda i: None)
    assert eng.pool.free_blocks == free and eng.lanes.busy() == set() and eng.lanes.caches[0].length == 0


@gpu_only
def test_the_gpu_load_runs_the_warmup_and_gives_everything_back(monkeypatch):
    """On a GPU the load runs the chunks (after the captures, in one progress report), and a request after it, in
    the lane it used, gets the tokens of an engine without graphs (bf16: fla-core's prefill kernels; the prompt
    runs eagerly on both, past the graphed size)."""
    chunks, real = [], warmup.warm_prefill

    def counted(target, drafter, cache, sizes, progress=None):
        chunks.append(list(sizes))
        real(target, drafter, cache, sizes, progress)

    monkeypatch.setattr(warmup, "warm_prefill", counted)
    seen = []

    def load(graphs: bool) -> Engine:
        return Engine(EngineConfig("synthetic:tiny", device="cuda", dtype="bfloat16", spec="dflash",
                                   drafter="synthetic:dflash-tiny", draft_tokens=7, max_context=1024,
                                   adaptive_drafts=False, cuda_graphs=graphs),  # the same steps in both
                      on_capture=lambda done, total: seen.append((done, total)))

    eng = load(True)
    assert chunks == [[512, 329]]
    assert len({total for _, total in seen}) == 1 and [done for done, _ in seen] == list(range(1, len(seen) + 1))
    stats = eng.stats()
    assert stats["prefill_tokens"] == 0 and stats["kv_tokens_in_use"] == 0 and stats["held_sequences"] == 0
    assert eng.lanes.busy() == set() and eng.lanes.caches[0].length == 0
    prompt = torch.randint(0, 256, (200,), generator=torch.Generator().manual_seed(4)).tolist()
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    replays = eng.runner.replays
    got = eng.complete(prompt, params)
    assert eng.runner.replays > replays and got.cached_tokens == 0
    assert got.token_ids == load(False).complete(prompt, params).token_ids
    assert chunks == [[512, 329], [512, 201]]  # without graphs every chunk runs eagerly
