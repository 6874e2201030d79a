"""CUDA-graph runner (GPU only: NINFER_TEST_DEVICE=cuda): replayed steps give the eager path's tokens, with and
without speculative decoding, including verify steps padded to the graph's size and rolled back."""

import pytest

from engine import Engine, EngineConfig, SamplingParams
from engine.runtime.generate import generate

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


def test_padded_verify_steps_roll_back():
    plain = engine(graphs=False).complete(prompt(), GREEDY).token_ids
    eng = engine("ngram")  # graphs of T = 1 and 8; the scripted drafter proposes fewer guesses at times
    drafter = Scripted(len(prompt()), plain)
    eng.cache.reset()
    events = list(generate(eng.runner, eng.tokenizer, prompt(), GREEDY, eng.cache, 16, drafter=drafter,
                           draft_tokens=3))
    assert events[-1].token_ids == plain
    assert 0 < events[-1].spec.acceptance_rate < 1 and eng.runner.replays > 0


def test_held_conversation_is_copied_back_into_the_working_cache():
    eng = engine()
    first = eng.complete(prompt(), GREEDY)
    follow = prompt() + first.token_ids + [5, 6, 7]
    again = eng.complete(follow, GREEDY)
    assert again.cached_tokens >= len(prompt())
    fresh = engine(graphs=False)
    assert again.token_ids == fresh.complete(follow, GREEDY).token_ids
