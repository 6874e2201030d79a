"""Tensor parallelism on the CPU: two processes over gloo, each running its shard of the tiny hybrid model, give
the logits of the whole model in one process (fp32, up to the order of the partial sums: < 1e-5 relative) for a
prefill, decode steps carrying the GDN state, a verify step rolled back and a batched step of two sequences, and
the same 64 greedy tokens; quantized weights cut before quantizing give those of the whole quantized model. The
engine over two ranks (rank 0 in this process) gives the one-process engine's tokens and logprobs through n-gram
verify rounds, held conversations (taken over, and shared from a checkpoint), batched steps and forked choices;
what it cannot run yet is refused; the memory plan is one rank's. Converted folders:
tests/test_tensor_parallel_converted.py."""
from __future__ import annotations

import pytest
import torch
import torch.multiprocessing as mp

from engine.config import WeightFormats
from engine.errors import UserError
from engine.loaders import load_model
from engine.loaders.synthetic import preset_spec
from engine.models import build_model
from engine.models.decoder import Row
from engine.parallel.comm import join, serve_store
from engine.parallel.layers import shard_model
from engine.parallel.shards import check_split, local_spec, rank_shapes, shard, shard_transform
from engine.quant.qweight import load_transform

from .conftest import admitted_together

WORLD = 2
CPU = torch.device("cpu")
Q8 = WeightFormats(attn="q8", mlp="q8", embed="q8", lm_head="q8")  # the tiny GDN out_proj is too narrow to cut


def steps(model) -> dict[str, torch.Tensor]:
    """A fixed run of one model: prefill, decode steps (the GDN state carried), a verify step of 4 tokens kept to
    2 (the recurrent state replayed), a batched step over two sequences (one decoding, one prefilling), then 64
    greedy tokens."""
    g = torch.Generator().manual_seed(3)
    prompt, other = torch.randint(0, 512, (20,), generator=g), torch.randint(0, 512, (9,), generator=g)
    out = {}
    with torch.inference_mode():
        cache = model.new_cache(256)
        out["prefill"] = model.forward(prompt, cache, all_logits=True)
        token, decoded = out["prefill"][-1:].argmax(-1), []
        for _ in range(6):
            decoded.append(model.forward(token, cache))
            token = decoded[-1].argmax(-1)
        out["decode"] = torch.cat(decoded)
        out["verify"] = model.forward(torch.cat([token, prompt[:3]]), cache, all_logits=True, keep_inputs=True)
        cache.commit(4, 2)
        second = model.new_cache(64)
        ids = torch.cat([prompt[5:6], other])
        out["batch"] = model.forward_rows(ids, [Row(cache, 1), Row(second, len(other), all_logits=True)])
        token, greedy = out["batch"][:1].argmax(-1), []
        for _ in range(64):
            token = model.forward(token, cache).argmax(-1)
            greedy.append(token)
        out["greedy"] = torch.cat(greedy)
    return out


FORMATS = {"fp32": WeightFormats(), "q8": Q8}


def _rank(rank: int, port: int, out: str) -> None:
    """One rank of a two-process run: its shard of the tiny model in each of FORMATS, the same `steps`; rank 0
    saves the results."""
    torch.set_num_threads(1)
    comm = join(port, rank, WORLD, CPU)
    spec, got = preset_spec("tiny"), {}
    for name, formats in FORMATS.items():
        transform = shard_transform(spec, rank, WORLD, load_transform(formats))
        loaded = load_model("synthetic:tiny", torch.float32, CPU, transform)
        got[name] = steps(shard_model(loaded.geometry, loaded.weights, "auto", comm))
    if rank == 0:
        torch.save(got, out)


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory) -> dict[str, dict[str, torch.Tensor]]:
    out, store = str(tmp_path_factory.mktemp("tp") / "rank0.pt"), serve_store(WORLD)  # the store the ranks meet at
    mp.start_processes(_rank, args=(store.port, out), nprocs=WORLD, start_method="spawn")
    return torch.load(out)


def one_rank(formats: WeightFormats) -> dict[str, torch.Tensor]:
    return steps(build_model(load_model("synthetic:tiny", torch.float32, CPU, load_transform(formats)), "auto"))


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


@pytest.mark.parametrize("name", FORMATS)
def test_two_ranks_give_the_whole_models_logits_and_tokens(name, two_ranks):
    want, got = one_rank(FORMATS[name]), two_ranks[name]
    for key in ("prefill", "decode", "verify", "batch"):
        assert got[key].shape == want[key].shape
        assert relative(got[key], want[key]) < 1e-5, key
    assert torch.equal(got["greedy"], want["greedy"])


def test_quantized_shards_are_the_whole_weights_rows():
    """Column cuts keep whole rows, row cuts whole groups: each rank's quantized piece is exactly the piece of the
    whole quantized weight."""
    from engine.quant.qweight import dequantize, quantize

    spec = preset_spec("tiny")
    w = torch.randn(128, 256)
    whole = dequantize(quantize(w, "q4"))
    for name, dim in (("layers.0.mlp.up_proj.weight", 0), ("layers.0.mlp.down_proj.weight", 1)):
        for rank in range(WORLD):
            piece = dequantize(quantize(shard(name, w, spec, rank, WORLD), "q4"))
            assert torch.equal(piece, whole.chunk(WORLD, dim)[rank])


def test_fused_gdn_projection_is_cut_per_block():
    """in_proj_qkv is [q | k | v]: each rank takes its heads of each block, in that order."""
    spec = preset_spec("tiny")
    key = spec.linear_num_key_heads * spec.linear_key_head_dim
    value = spec.linear_num_value_heads * spec.linear_value_head_dim
    w = torch.arange(2 * key + value, dtype=torch.float32)[:, None].expand(-1, spec.hidden_size)
    piece = shard("layers.0.linear_attn.in_proj_qkv.weight", w, spec, 1, WORLD)[:, 0].long().tolist()
    q, k, v = range(key), range(key, 2 * key), range(2 * key, 2 * key + value)
    assert piece == [*q[key // 2:], *k[key // 2:], *v[value // 2:]]
    name = "layers.0.linear_attn.in_proj_qkv.weight"
    assert rank_shapes({name: (2 * key + value, spec.hidden_size)}, WORLD)[name] == (len(piece), spec.hidden_size)
    assert local_spec(spec, WORLD).linear_num_value_heads == spec.linear_num_value_heads // 2


@pytest.mark.parametrize("world, formats, words", [
    (3, {}, "does not divide the model's 4 attention heads"),
    (2, {"gdn": "q8"}, "not whole groups of 64"),
])
def test_cuts_that_cannot_work_are_refused(world, formats, words):
    with pytest.raises(UserError, match=words):
        check_split(preset_spec("tiny"), world, formats)


# ---- the engine over two ranks ---------------------------------------------------------------------------------

SETTINGS = dict(device="cpu", dtype="float32", threads=1, spec="ngram", adaptive_drafts=False, max_concurrency=2,
                draft_acceptance=0.6)  # drafts learned from the first pass, right at a set rate: rounds keep some


@pytest.fixture(scope="module")
def engines():
    """The tiny model in one process and over two (rank 0 here, rank 1 a process it started)."""
    from engine import Engine, EngineConfig

    one = Engine(EngineConfig("synthetic:tiny", **SETTINGS))
    two = Engine(EngineConfig("synthetic:tiny", tensor_parallel=2, **SETTINGS))
    yield one, two
    two.close()
    one.close()


def run_both(engines, prompt, **params):
    """The request on each engine, greedy, with each output token's logprob."""
    from engine import SamplingParams

    return [e.complete(prompt, SamplingParams(temperature=0, logprobs=0, **params)) for e in engines]


def same_output(want, got) -> bool:
    """The same tokens with the same logprobs (these see what greedy tokens may not: a KV row or a state copied
    wrong moves them by ~1e-2 on the tiny model; the ranks' partial sums by ~1e-6)."""
    return got.token_ids == want.token_ids and all(
        abs(a.logprob - b.logprob) < 1e-4 for a, b in zip(got.logprobs, want.logprobs, strict=True))


def test_engine_over_two_ranks_decodes_and_verifies_as_one(engines):
    """64 greedy tokens, then the same request again: its n-gram rounds draft the learned continuation (the
    verify steps keep part of each round, the GDN state rolled back); both passes give the one-process output."""
    prompt = list(range(40, 100))
    for _ in range(2):
        want, got = run_both(engines, prompt, max_tokens=64)
        assert same_output(want, got) and len(got.token_ids) == 64
        assert got.spec.accepted == want.spec.accepted
    assert got.spec.accepted > 0


def test_engine_over_two_ranks_reuses_held_conversations(engines):
    """An edited reply shares a held conversation's full blocks (the rest of its KV rows copied) from its
    prompt-end checkpoint (a snapshot restored); a next turn takes a held conversation over (its state restored)."""
    first = list(range(120, 230))
    want, got = run_both(engines, first, max_tokens=20)
    for prompt in (first + list(range(300, 320)), first + want.token_ids + list(range(340, 380))):
        want, got = run_both(engines, prompt, max_tokens=20)
        assert same_output(want, got) and got.cached_tokens == want.cached_tokens >= len(first)


def test_engine_over_two_ranks_batches_and_forks(engines):
    """Two requests decode in one batched step; two sampled choices of one prompt fork the first one's cache."""
    from engine import SamplingParams

    outputs = []
    for e in engines:
        greedy = SamplingParams(temperature=0, max_tokens=24, logprobs=0)
        with admitted_together(e):  # both engines batch the same requests in the same steps, however busy the cores
            streams = [e.submit(list(range(200 + i, 260 + i)), greedy) for i in range(2)]
            streams += e.submit_choices(list(range(10, 114)),
                                        SamplingParams(temperature=0.8, seed=7, max_tokens=24, logprobs=0), 2)
        outputs.append([list(s)[-1] for s in streams])
    assert all(same_output(want, got) for want, got in zip(*outputs, strict=True))
    assert engines[1].core.batched_steps > 0


def test_engine_refuses_what_two_ranks_cannot_run_yet():
    from engine import Engine, EngineConfig

    with pytest.raises(UserError, match="does not divide the model's 4 attention heads"):
        Engine(EngineConfig("synthetic:tiny", device="cpu", tensor_parallel=3))


def test_memory_plan_is_one_ranks_share():
    """Per rank: half the KV heads and GDN heads (their KV and state exactly halve), half of every cut weight,
    the norms whole; the logits stay whole (every rank gathers them)."""
    from engine.config import EngineConfig
    from engine.memory_plan import plan_memory

    spec = preset_spec("qwen3.6-27b")
    one, two = (plan_memory(spec, EngineConfig("synthetic:qwen3.6-27b", tensor_parallel=n), "cuda") for n in (1, 2))
    assert two.kv_pool * 2 == one.kv_pool and two.state_slots * 2 == one.state_slots
    assert one.weights / 2 < two.weights < one.weights / 2 * 1.001
    with pytest.raises(UserError, match="does not divide the model's 4 KV heads"):
        plan_memory(spec, EngineConfig("synthetic:qwen3.6-27b", tensor_parallel=8), "cuda")


def test_memory_plan_counts_what_rank_0_holds_alone():
    """The plan is rank 0's, the largest: with MTP it holds the embedding and LM head whole (the drafter reads
    them) and the MTP layer's KV for all heads; the vision tower runs there too."""
    from engine.config import EngineConfig, WeightFormats
    from engine.memory_plan import plan_memory
    from engine.models import weight_shapes

    spec = preset_spec("qwen3.6-27b")
    config = {"weights": WeightFormats.uniform("bf16"), "kv_capacity": 8192}
    one, two = (plan_memory(spec, EngineConfig("synthetic:qwen3.6-27b", spec="mtp", tensor_parallel=n, **config),
                            "cuda") for n in (1, 2))
    plain = plan_memory(spec, EngineConfig("synthetic:qwen3.6-27b", tensor_parallel=2, **config), "cuda")
    shapes = weight_shapes(spec)
    vocab = sum(shapes[n][0] * shapes[n][1] for n in ("embed_tokens.weight", "lm_head.weight")) * 2  # bf16
    assert two.weights - plain.weights == vocab // 2  # the other half of both
    assert two.drafter == one.drafter


def test_fit_cli_plans_one_gpu_of_several():
    from .conftest import run_cli

    r = run_cli("profiles", "fit", "8k-speed", "--gpu-mem-gib", "16", "--tensor-parallel", "2")
    # planned per GPU, and refused as the engine refuses it: it has not run on GPUs yet
    assert r.returncode == 2 and "per GPU of 2 (tensor_parallel)" in r.stdout and "REFUSED" in r.stdout
    assert 'tensor_parallel = 2 does not run with GPUs yet (use device = "cpu"' in r.stdout
    r = run_cli("profiles", "fit", "8k-speed", "--gpu-mem-gib", "16", "--tensor-parallel", "3")
    assert r.returncode == 2 and r.stderr.startswith("error: tensor_parallel = 3 does not divide")
