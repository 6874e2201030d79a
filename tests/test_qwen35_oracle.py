"""The Qwen3.5 hybrid reference forward against transformers' qwen3_5 on the same files (fp32, CPU)."""
import os

import pytest
import torch

from engine import Engine, EngineConfig, SamplingParams

from .conftest import hf_greedy, rel_error, run_cli, write_tiny

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.slow  # transformers' forward is the oracle

# The same tests run on a GPU with NINFER_TEST_DEVICE=cuda (the oracle stays on the CPU in fp32).
DEVICE = os.environ.get("NINFER_TEST_DEVICE", "cpu")

# Three tiny configs that differ in layer pattern, head counts, head dims, partial rotary and tying.
CONFIGS = {
    "interval4-untied": {},
    "explicit-pattern-tied": {
        "num_hidden_layers": 6, "layer_types": ["full_attention", "linear_attention", "linear_attention",
                                                "full_attention", "linear_attention", "full_attention"],
        "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 64, "linear_num_key_heads": 4,
        "linear_num_value_heads": 4, "linear_key_head_dim": 32, "linear_value_head_dim": 16,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1e6, "partial_rotary_factor": 0.5},
        "tie_word_embeddings": True},
    "interval2-gva3": {
        "num_hidden_layers": 4, "full_attention_interval": 2, "num_attention_heads": 6, "num_key_value_heads": 3,
        "head_dim": 16, "linear_num_key_heads": 1, "linear_num_value_heads": 3, "linear_key_head_dim": 8,
        "linear_value_head_dim": 24, "intermediate_size": 96,
        "rope_parameters": {"rope_type": "default", "rope_theta": 5e5, "partial_rotary_factor": 1.0}},
}


@pytest.fixture(scope="module", params=list(CONFIGS))
def pair(request, tmp_path_factory):
    folder = write_tiny(tmp_path_factory.mktemp(request.param), seed=len(request.param), **CONFIGS[request.param])
    ours = Engine(EngineConfig(model=str(folder), device=DEVICE, dtype="float32"))
    ref = transformers.AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    return folder, ours, ref


def prompt(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed))


def logits_of(engine, ids, chunk=None, cache_len=None):
    model = engine.model
    cache = model.new_cache(cache_len or len(ids))
    chunk = chunk or len(ids)
    with torch.inference_mode():
        ids = ids.to(model.device)
        return torch.cat([model.forward(ids[i:i + chunk], cache, all_logits=True) for i in range(0, len(ids), chunk)])


def test_logits_match_transformers(pair):
    _, ours, ref = pair
    ids = prompt(300)
    with torch.inference_mode():
        expected = ref(ids[None]).logits[0]
    assert rel_error(logits_of(ours, ids), expected) < 1e-4


def test_greedy_48_matches_transformers(pair):
    _, ours, ref = pair
    ids = prompt(40, seed=3).tolist()
    got = ours.complete(ids, SamplingParams(max_tokens=48, temperature=0, ignore_eos=True)).token_ids
    assert got == hf_greedy(ref, ids, 48)


@pytest.mark.parametrize("chunk", [1, 16, 64, 1024])
def test_chunked_prefill_and_decode_equal_one_shot(pair, chunk):
    # fp32: the WY (chunked) and token-by-token forms round differently; each is ~1e-5 from an fp64 run over
    # 300 tokens of these random models (as is transformers' own fp32 forward), so their gap is bounded by 3e-5.
    # In fp64 the forms must agree to rounding: that is the equivalence proof.
    folder, ours, _ = pair
    ids = prompt(300, seed=5)
    assert rel_error(logits_of(ours, ids, chunk), logits_of(ours, ids)) < 3e-5
    exact = Engine(EngineConfig(model=str(folder), device=DEVICE, dtype="float64"))
    assert rel_error(logits_of(exact, ids, chunk), logits_of(exact, ids)) < 1e-10


@pytest.mark.parametrize("dtype,bound", [("float32", 3e-5), ("float64", 1e-10)])
def test_t8_step_equals_eight_single_steps(pair, dtype, bound):
    folder = pair[0]
    model = Engine(EngineConfig(model=str(folder), device=DEVICE, dtype=dtype)).model
    ids = prompt(72, seed=7).to(model.device)
    a, b = model.new_cache(72), model.new_cache(72)
    with torch.inference_mode():
        model.forward(ids[:64], a)
        model.forward(ids[:64], b)
        block = model.forward(ids[64:], a, all_logits=True)
        singles = torch.cat([model.forward(ids[i:i + 1], b) for i in range(64, 72)])
    assert rel_error(block, singles) < bound
    assert rel_error(a.states.recurrent, b.states.recurrent) < bound


def test_long_prompt_4096_chunk_512(tmp_path):
    folder = write_tiny(tmp_path / "long", seed=11)
    ours = Engine(EngineConfig(model=str(folder), device=DEVICE, dtype="float32", prefill_chunk=512))
    ref = transformers.AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    ids = prompt(4096, seed=13)
    with torch.inference_mode():
        expected = ref(ids[None], logits_to_keep=1).logits[0, -1]
        cache = ours.model.new_cache(4096)
        dev_ids = ids.to(ours.model.device)
        for i in range(0, 4096, 512):
            last = ours.model.forward(dev_ids[i:i + 512], cache)[-1]
    assert rel_error(last, expected) < 1e-4


@pytest.mark.parametrize("kv_dtype,bound", [("int8", 2e-2), ("fp8", 1e-1)])
def test_8bit_kv_close_to_bf16_kv(tmp_path, kv_dtype, bound):
    # Bound: per-(token, head) int8 rounds each K/V element to 1/254 of the head's absmax (fp8 e4m3: 1/16 of
    # the value); through softmax and a few layers that stays ~1e-3 (int8) / ~2e-2 (fp8) of the logits' norm;
    # the bounds leave 10x / 5x margin and still catch a wrong scale (errors of O(1)).
    folder = write_tiny(tmp_path / "kv", seed=17)
    runs = {}
    for dt in ("bf16", kv_dtype):
        eng = Engine(EngineConfig(model=str(folder), device=DEVICE, dtype="float32", kv_dtype=dt))
        ids = prompt(200, seed=19)
        runs[dt] = (logits_of(eng, ids),
                    eng.complete(ids[:32].tolist(), SamplingParams(max_tokens=64, temperature=0,
                                                                     ignore_eos=True)).token_ids)
    error = rel_error(runs[kv_dtype][0], runs["bf16"][0])
    print(f"{kv_dtype} KV vs bf16 KV logits rel error: {error:.2e}")
    assert error < bound
    assert runs[kv_dtype][1] == runs["bf16"][1]


@pytest.mark.skipif(DEVICE != "cpu", reason="the CLI runs on the CPU here; the CPU run of this suite covers it")
def test_cli_generate_matches_transformers_greedy(pair):
    folder, _, ref = pair
    ids = prompt(20, seed=23).tolist()
    r = run_cli("generate", "--model", str(folder), "--device", "cpu", "--prompt-ids", ",".join(map(str, ids)),
                "--temperature", "0", "--repeat-penalty", "1", "-n", "24", "--json")
    assert r.returncode == 0, r.stderr
    import json

    out = json.loads(r.stdout)
    expected = hf_greedy(ref, ids, 24)
    eos = 258
    if eos in expected:
        expected = expected[: expected.index(eos)]
    assert out["token_ids"] == expected
