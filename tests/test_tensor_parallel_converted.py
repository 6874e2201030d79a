"""Tensor parallelism from a converted folder (`ninfer convert`), whose weights are stored quantized whole: each rank
cuts every stored weight on its groups' (GGUF blocks') boundaries into exactly the codes and scales its float piece
quantizes to; two ranks (two processes over gloo) on a converted folder give the one-process logits (< 1e-5) and
greedy tokens, with a drafter on rank 0 reading the whole embedding and LM head; a folder whose stored groups a cut
would break is refused with the conversion that can be cut."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from engine import Engine, EngineConfig, SamplingParams, UserError
from engine.config import WeightFormats
from engine.convert import convert
from engine.loaders.synthetic import preset_spec
from engine.parallel.shards import cut, first_rows, shard
from engine.quant.gguf_blocks import GGUFWeight, from_blocks
from engine.quant.gguf_blocks import concat as concat_blocks
from engine.quant.gguf_blocks import dequantize as dequantize_blocks
from engine.quant.qweight import QuantizedWeight, quantize, tile, tileable

from .conftest import rel_error, write_tiny
from .test_tensor_parallel import WORLD, same_output

gguf = pytest.importorskip("gguf")
pytest.importorskip("transformers")  # the tiny folder is written through it
Q = gguf.GGMLQuantizationType
SPEC = preset_spec("tiny")
# the tiny GDN output projection (64 inputs) is too narrow to cut in groups of 64: its class stays plain
CUTTABLE = WeightFormats(attn="q5", gdn="auto", mlp="q4", embed="q8", lm_head="q8")
QKV = "layers.0.linear_attn.in_proj_qkv.weight"  # rows [q | k | v] (32 | 32 | 64 on the tiny model)
CUTS = {"layers.0.mlp.up_proj.weight": 0, "layers.0.mlp.down_proj.weight": 1, QKV: 0}


def stored(q: QuantizedWeight) -> tuple:
    return q.fmt, q.tiled, q.out_features, q.in_features, q.codes, q.scales, q.high


def same_stored(a: QuantizedWeight, b: QuantizedWeight) -> bool:
    return all(torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y
               for x, y in zip(stored(a), stored(b), strict=True))


@pytest.mark.parametrize("fmt", ["q8", "q5", "q4"])
def test_a_stored_weights_piece_is_its_float_pieces_quantization(fmt):
    """Bit for bit, row-major and tiled: what a converted folder's rank holds is what the checkpoint's rank
    quantizes at load."""
    w = torch.randn(128, 512, generator=torch.Generator().manual_seed(1))
    for name in CUTS:
        for rank in range(WORLD):
            want = quantize(shard(name, w, SPEC, rank, WORLD), fmt)
            assert same_stored(shard(name, quantize(w, fmt), SPEC, rank, WORLD), want), (name, rank)
            if fmt != "q8" and tileable(want):
                assert same_stored(shard(name, tile(quantize(w, fmt)), SPEC, rank, WORLD), tile(want)), (name, rank)


def test_gguf_blocks_are_cut_on_their_rows_and_blocks():
    """A weight of two runs of types (Q8_0, Q4_1: blocks of 32): a rank's rows cross the runs (those of one
    type joined again), its input columns are whole blocks; rank 0's first rows are views of the whole."""
    rng = np.random.default_rng(2)
    runs = [(Q.Q8_0, 40), (Q.Q4_1, 88)]
    w = concat_blocks([from_blocks(t, torch.from_numpy(gguf.quants.quantize(
        rng.standard_normal((rows, 128)).astype(np.float32), t)), 128, torch.float32) for t, rows in runs])
    whole = dequantize_blocks(w)
    for name, dim in CUTS.items():
        sizes = (32, 32, 64) if name == QKV else None
        for rank in range(WORLD):
            piece = shard(name, w, SPEC, rank, WORLD)
            assert isinstance(piece, GGUFWeight) and piece.shape == cut(whole, dim, rank, WORLD, sizes).shape
            assert torch.equal(dequantize_blocks(piece), cut(whole, dim, rank, WORLD, sizes)), (name, rank)
    assert [p.qtype for p in shard(QKV, w, SPEC, 1, WORLD).parts] == [Q.Q8_0, Q.Q4_1]  # rows 16-32 | 48-64, 96-128
    head = first_rows(w, 64)
    assert torch.equal(dequantize_blocks(head), whole[:64])
    assert head.parts[1].data.data_ptr() == w.parts[1].data.data_ptr()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_tiny(tmp_path_factory.mktemp("tiny"), seed=3)


SETTINGS = dict(device="cpu", dtype="float32", threads=1, spec="dflash", drafter="synthetic:dflash-tiny",
                adaptive_drafts=False)  # rank 0 loads the embedding and LM head whole: the drafter reads them
IDS = list(range(30, 70))


def run(folder, n: int):
    """The prompt's logits and a greedy request's output (its drafts verified), from `folder` over n ranks."""
    engine = Engine(EngineConfig(str(folder), tensor_parallel=n, **SETTINGS))
    try:
        with torch.inference_mode():
            logits = engine.model.forward(torch.tensor(IDS), engine.model.new_cache(len(IDS)), all_logits=True)
        return logits, engine.complete(IDS, SamplingParams(temperature=0, max_tokens=24, logprobs=0))
    finally:
        engine.close()


def test_two_ranks_on_a_converted_folder_are_one_process(tiny, tmp_path):
    folder = convert(str(tiny), tmp_path / "q", CUTTABLE, torch.float32).folder
    (want_logits, want), (got_logits, got) = run(folder, 1), run(folder, 2)
    assert rel_error(got_logits, want_logits) < 1e-5
    assert same_output(want, got) and len(got.token_ids) == 24


@pytest.mark.slow
def test_two_ranks_on_a_folder_of_gguf_blocks_are_one_process(tiny, tmp_path):
    """A GGUF converted as it is (its blocks kept for the CPU kernels), row- and column-parallel weights and the
    embedding among its Q8_0 tensors."""
    from engine.kernels import cpu_gguf
    from engine.loaders import load_model

    from .test_gguf_qwen35 import QUANTIZED, write_qwen35_gguf

    if not cpu_gguf.available():
        pytest.skip("no C compiler: GGUF blocks are dequantized at load here")
    blocks = {**QUANTIZED, "token_embd.weight": Q.Q8_0, "blk.0.ffn_down.weight": Q.Q8_0,
              "blk.3.attn_output.weight": Q.Q8_0}
    path = write_qwen35_gguf(tiny, tmp_path / "tiny.gguf", blocks)
    folder = convert(str(path), tmp_path / "gguf", WeightFormats(), torch.float32).folder
    loaded = load_model(str(folder), torch.float32, torch.device("cpu")).weights
    assert all(isinstance(loaded[name], GGUFWeight) for name in ("embed_tokens.weight",
                                                                "layers.3.self_attn.o_proj.weight"))
    (want_logits, want), (got_logits, got) = run(folder, 1), run(folder, 2)
    assert rel_error(got_logits, want_logits) < 1e-5
    assert same_output(want, got)


def test_a_folder_whose_groups_a_cut_would_break_is_refused(tiny, tmp_path):
    folder = convert(str(tiny), tmp_path / "q8", WeightFormats.uniform("q8"), torch.float32).folder
    with pytest.raises(UserError, match="cuts layers.0.linear_attn.out_proj.weight .64 inputs. into 32-wide shards, "
                       "not whole groups of 64 for its q8 format") as exc:
        Engine(EngineConfig(str(folder), device="cpu", tensor_parallel=2))
    assert "ninfer convert" in exc.value.hint and "--set weights.gdn=bf16" in exc.value.hint
