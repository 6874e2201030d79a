"""The first answer on a CPU: the default profile's sampling ends replies, and the fast GGUF load reads exactly what
the `gguf` package reads."""
import argparse
import subprocess
import sys

import numpy as np
import pytest
import torch

from engine.errors import ModelFormatError
from ninfer_tui import profiles

from .conftest import ROOT

gguf = pytest.importorskip("gguf")
Q = gguf.GGMLQuantizationType


# ---- the CPU default's sampling ------------------------------------------------------------------------------

def _reply(engine, text: str, params):
    from ninfer_tui.chat_client import LocalClient

    final = None
    for ev in LocalClient(engine, "cpu-default").reply([{"role": "user", "content": text}], params):
        if ev.kind == "done":
            final = ev
    return final


def test_cpu_default_sampling_ends_replies(default_engine):
    """`echo hi | ninfer` once looped for 512 tokens ("I'm here to help. I'm a chatbot designed to help, ..."): the
    profile's repetition penalty ends such replies at EOS, and its max_tokens bounds a chat reply."""
    import dataclasses

    from ninfer_tui.launch import sampling_from_args

    profile = profiles.load("cpu-default")
    params = sampling_from_args(argparse.Namespace(), profile)  # what a piped chat with no flags uses
    assert params.repetition_penalty > 1.0 and params.max_tokens <= 256
    for text, seed in (("hi", 9), ("hi", 3)):  # seed 9 loops to the cap without the penalty
        final = _reply(default_engine, text, dataclasses.replace(params, seed=seed))
        assert final.finish_reason == "stop", (text, seed, final.completion_tokens)
        assert final.completion_tokens < params.max_tokens


# ---- the GGUF reader and dequantization ----------------------------------------------------------------------

def _write(path, tensors: dict, **kv):
    w = gguf.GGUFWriter(str(path), "llama")
    for key, value in kv.items():
        w.add_key_value(key, *value)
    for name, (data, qtype) in tensors.items():
        if qtype in (Q.F32, Q.F16):
            w.add_tensor(name, data.astype(np.float32 if qtype == Q.F32 else np.float16))
        else:
            w.add_tensor(name, gguf.quants.quantize(data, qtype), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_header_matches_the_gguf_package(tmp_path):
    """Every metadata value type and the tensor table, against GGUFReader."""
    from engine.loaders.gguf_file import read_header, tensor_bytes

    V = gguf.GGUFValueType
    rng = np.random.default_rng(0)
    kv = {"u8": (7, V.UINT8), "i16": (-3, V.INT16), "u32": (4096, V.UINT32), "i64": (-(2**40), V.INT64),
          "f32": (1e-5, V.FLOAT32), "f64": (0.1, V.FLOAT64), "flag": (True, V.BOOL), "name": ("smöl ✓", V.STRING),
          "tokens": (["a", "Ġthe", "<|im_end|>", "", "ü"], V.ARRAY, V.STRING), "types": ([1, 3, 4], V.ARRAY, V.INT32),
          "scores": ([0.5, -1.25], V.ARRAY, V.FLOAT32)}
    tensors = {"a.weight": (rng.standard_normal((8, 64)), Q.Q4_1), "b.weight": (rng.standard_normal(64), Q.F32),
               "c.weight": (rng.standard_normal((3, 32)), Q.Q8_0), "d.weight": (rng.standard_normal((2, 32)), Q.F16)}
    path = _write(tmp_path / "all.gguf", tensors, **kv)
    ours, ref = read_header(path), gguf.GGUFReader(str(path))
    want = {k: f.contents() for k, f in ref.fields.items() if not k.startswith("GGUF.")}
    assert ours.metadata == want
    assert all(type(ours.metadata[k]) is type(want[k]) for k in want)
    assert [(t.name, t.qtype, t.shape) for t in ours.tensors] == \
        [(t.name, int(t.tensor_type), tuple(int(d) for d in reversed(t.shape))) for t in ref.tensors]
    raw = tensor_bytes(path, ours)
    for t in ref.tensors:
        assert np.array_equal(raw[t.name], np.asarray(t.data).view(np.uint8).reshape(-1)), t.name


@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0, Q.F16, Q.BF16, Q.F32])
def test_dequantize_is_bit_identical_to_the_gguf_package(qtype):
    from engine.loaders.gguf_dequant import dequantize

    rng = np.random.default_rng(int(qtype))
    w = (rng.standard_normal((16, 256)) * rng.uniform(0.01, 4, (16, 1))).astype(np.float32)
    w[0] = 0  # all-zero blocks: a zero scale
    stored = gguf.quants.quantize(w, qtype)
    want = gguf.quants.dequantize(stored, qtype).astype(np.float32)
    got = dequantize(stored.view(np.uint8).reshape(-1), int(qtype), (16, 256))
    assert got.dtype == np.float32 and got.shape == (16, 256)
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32))


def test_default_model_tensors_are_the_gguf_packages(default_engine):
    """The real file's tensors of each type (Q8_0 embedding, Q4_1 projections, F32 norms) reach the model bit for
    bit as the gguf package decodes them, q's rows in HF's rotate-half order. On the CPU the quantized ones stay
    the file's blocks (`quant/gguf_blocks.py`, read by the CPU kernels): their decoding is what is compared."""
    from pathlib import Path

    from engine.loaders.gguf_file import read_header, tensor_bytes
    from engine.quant.gguf_blocks import GGUFWeight, dequantize

    def dense(w):
        return dequantize(w) if isinstance(w, GGUFWeight) else w

    path = Path(default_engine.model_name)
    header = read_header(path)
    raw = tensor_bytes(path, header)
    model, heads = default_engine.model, default_engine.geometry.num_heads
    q_rows = model.qkv_split[0]
    from engine.kernels import cpu_gguf

    if cpu_gguf.available():  # else (no C compiler) the loader dequantizes them
        assert isinstance(model.embed, GGUFWeight) and isinstance(model.layers[0]["qkv"], GGUFWeight)
    ours = {"token_embd.weight": dense(model.embed), "blk.0.attn_q.weight": dense(model.layers[0]["qkv"])[:q_rows],
            "blk.0.ffn_down.weight": dense(model.layers[0]["down"]),
            "blk.3.attn_norm.weight": model.layers[3]["in_norm"]}
    checked = set()
    for t in header.tensors:
        if t.name not in ours:
            continue
        rows = int(np.prod(t.shape[:-1]))
        want = gguf.quants.dequantize(raw[t.name].reshape(rows, -1), Q(t.qtype)).astype(np.float32).reshape(t.shape)
        if t.name.endswith("attn_q.weight"):  # llama.cpp interleaves each head's rotary halves
            want = want.reshape(heads, -1, 2, t.shape[-1]).swapaxes(1, 2).reshape(t.shape)
        got = ours[t.name].contiguous().numpy()
        assert np.array_equal(got.view(np.uint32), want.view(np.uint32)), t.name
        checked.add(t.qtype)
    assert checked == {Q.Q8_0, Q.Q4_1, Q.F32}


def test_truncated_or_foreign_files_say_so(tmp_path):
    from engine.loaders.gguf_file import read_header

    path = _write(tmp_path / "t.gguf", {"a.weight": (np.ones((4, 32)), Q.Q8_0)})
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(path.read_bytes()[:-100])  # into the tensor data (the end is padding)
    with pytest.raises(ModelFormatError, match="runs past the end of the file"):
        read_header(cut)
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + (7).to_bytes(4, "little") + bytes(32))
    with pytest.raises(ModelFormatError, match="version 7"):
        read_header(bad)


def test_a_row_that_does_not_end_on_a_block_says_so(tmp_path):
    """A tensor table whose quantized rows do not end on a block (a damaged file) is refused by name when the
    header is read, not met as a reshape error on a decode thread."""
    import struct

    from engine.loaders.gguf_file import read_header

    data = _write(tmp_path / "t.gguf", {"a.weight": (np.ones((4, 32)), Q.Q8_0)}).read_bytes()
    dims = struct.pack("<IQQ", 2, 32, 4)  # the table lists the fastest dimension first
    assert data.count(dims) == 1
    bad = tmp_path / "rows.gguf"
    bad.write_bytes(data.replace(dims, struct.pack("<IQQ", 2, 40, 3)))  # 120 values: fewer bytes than stored
    with pytest.raises(ModelFormatError, match=r"'a.weight' has rows of 40 values, not a multiple of the Q8_0 block"):
        read_header(bad)


# ---- what a CPU start imports ----------------------------------------------------------------------------------

def test_cpu_model_code_does_not_import_dynamo():
    """torch.nn.attention.bias imports torch._dynamo (seconds of a CPU start); the CPU path computes the same
    attention without it."""
    code = ("import sys, torch\nfrom engine.models.layers import causal_attention\n"
            "q, kv = torch.randn(5, 4, 8), torch.randn(9, 2, 8)\ncausal_attention(q, kv, kv, 4, 0.3)\n"
            "causal_attention(kv.repeat(1, 2, 1), kv, kv, 0, 0.3)\nprint('torch._dynamo' in sys.modules)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "False"


@pytest.mark.parametrize("t,length", [(6, 6), (5, 17), (2, 3)])
def test_cpu_causal_attention_equals_the_lower_right_bias(t, length):
    import torch.nn.functional as F
    from torch.nn.attention.bias import causal_lower_right

    from engine.models.layers import causal_attention

    g = torch.Generator().manual_seed(t * 100 + length)
    q, k, v = (torch.randn(n, h, 16, generator=g) for n, h in ((t, 4), (length, 2), (length, 2)))
    want = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
                                          attn_mask=causal_lower_right(t, length), scale=0.25, enable_gqa=True)
    assert torch.equal(causal_attention(q, k, v, length - t, 0.25), want[0].transpose(0, 1))
