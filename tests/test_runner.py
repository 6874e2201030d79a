"""CUDA-graph runner (GPU only: NINFER_TEST_DEVICE=cuda): replayed steps give the eager path's tokens, with and
without speculative decoding, including verify steps padded to the graph's size and rolled back."""

import threading

import pytest

from engine import Engine, EngineConfig, SamplingParams
from engine.config import WeightFormats
from engine.runtime.generate import generate
from engine.runtime.request import FinishEvent, TokenEvent

from .conftest import gpu_only
from .test_spec import DRAFTERS, GREEDY, Scripted, prompt

pytestmark = gpu_only  # CUDA graphs need a GPU


def engine(spec: str = "none", graphs: bool = True, dtype: str = "float32", kv: str = "auto") -> Engine:
    return Engine(EngineConfig("synthetic:tiny", device="cuda", dtype=dtype, kv_dtype=kv, spec=spec,
                               drafter=DRAFTERS.get(spec, ""), draft_tokens=7, cuda_graphs=graphs))


@pytest.mark.parametrize("spec", ["none", *DRAFTERS])
def test_graph_steps_match_eager_steps(spec):
    eager = engine(spec, graphs=False).complete(prompt(), GREEDY)
    eng = engine(spec)
    replayed = eng.complete(prompt(), GREEDY)
    assert eng.runner.replays > 0
    assert replayed.token_ids == eager.token_ids
    if spec != "none":  # the same drafts too (MTP drafts replay a graph of their own): a lossless check alone
        assert replayed.spec.accepted == eager.spec.accepted  # would pass with wrong drafts


@pytest.mark.parametrize("kv", ["bf16", "int8", "fp8"])
def test_graphs_on_bf16_with_8bit_kv(kv):
    params = SamplingParams(max_tokens=64, temperature=0, ignore_eos=True)
    eager = engine(graphs=False, dtype="bfloat16", kv=kv).complete(prompt(), params)
    eng = engine(dtype="bfloat16", kv=kv)
    assert eng.complete(prompt(), params).token_ids == eager.token_ids


def test_a_drafter_keeps_one_lane_and_admits_one_request():
    eng = Engine(EngineConfig("synthetic:tiny", device="cuda", dtype="float32", spec="ngram", max_concurrency=4))
    assert eng.stats()["lanes"] == 1 and eng.admission.max_running == 1


def test_padded_verify_steps_roll_back():
    plain = engine(graphs=False).complete(prompt(), GREEDY).token_ids
    eng = engine("ngram")  # graphs of T = 1 and 8; the scripted drafter proposes fewer guesses at times
    drafter = Scripted(len(prompt()), plain)
    lane = eng.lanes.caches[0]
    lane.reset()
    events = list(generate(eng.runner, eng.tokenizer, prompt(), GREEDY, lane, 16, drafter=drafter,
                           draft_tokens=3))
    assert events[-1].token_ids == plain
    assert 0 < events[-1].spec.acceptance_rate < 1 and eng.runner.replays > 0


def _at_once(eng: Engine, prompts: list[list[int]], params: SamplingParams, late: int = 0) -> list[list[int]]:
    """Every prompt in a thread of its own, as the API server runs requests; the last `late` start once the
    others have decoded a few tokens (their prefill runs while the others' lanes are mid-sequence)."""
    out: dict[int, list[int]] = {}
    started = threading.Event()

    def run(i: int) -> None:
        tokens = 0
        for event in eng.generate(prompts[i], params):
            tokens += isinstance(event, TokenEvent) and event.token_id is not None
            if tokens >= 3:
                started.set()
            if isinstance(event, FinishEvent):
                out[i] = event.token_ids

    early = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts) - late)]
    for t in early:
        t.start()
    started.wait(60)
    rest = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts) - late, len(prompts))]
    for t in rest:
        t.start()
    for t in early + rest:
        t.join(300)
    return [out[i] for i in range(len(prompts))]


@pytest.mark.parametrize(("n", "late"), [(4, 0), (3, 1)])
def test_concurrent_requests_step_together_in_batch_graphs(monkeypatch, n, late):
    """n requests at once in lanes of one engine: each gets the tokens it gets alone, and their decode steps
    replayed batch buckets' graphs (3 running lanes take bucket 4 with a free lane; a late request prefills while
    the others hold their lanes, so some steps take each lane's own graph). Every matmul is one int8 kernel (q8
    weights, v8 pinned), which computes a row alike whatever rows run beside it: random tiny models turn any
    rounding difference (cuBLAS picks other kernels for 1 and 4 rows) into other greedy tokens."""
    from engine.kernels import qmatmul

    every = qmatmul.candidates
    monkeypatch.setattr(qmatmul, "candidates", lambda n, k, sms, fmt, rows=None, tiled=False: [
        c for c in every(n, k, sms, fmt) if c.version == "v8"][:1])
    monkeypatch.setattr(qmatmul, "_chosen", {})
    prompts = [prompt()[i:] + [7 + i] * i for i in range(n)]
    params = SamplingParams(max_tokens=48, temperature=0, ignore_eos=True)
    eng = Engine(EngineConfig("synthetic:tiny", device="cuda", dtype="float32", max_concurrency=4,
                              max_context=256, held_sequences=0, weights=WeightFormats.uniform("q8")))
    assert eng.stats()["lanes"] == 4 and eng.stats()["cuda_graph_batches"] == [2, 4]
    assert eng.admission.max_running == 4
    alone = [eng.complete(p, params).token_ids for p in prompts]
    replays = eng.runner.batch_replays
    assert _at_once(eng, prompts, params, late) == alone
    assert eng.runner.batch_replays > replays and eng.stats()["batched_steps"] > 0


def test_held_conversation_is_copied_back_into_the_working_cache():
    eng = engine()
    first = eng.complete(prompt(), GREEDY)
    follow = prompt() + first.token_ids + [5, 6, 7]
    again = eng.complete(follow, GREEDY)
    assert again.cached_tokens >= len(prompt())
    fresh = engine(graphs=False)
    assert again.token_ids == fresh.complete(follow, GREEDY).token_ids
