"""The C kernels of the CPU path against their references: GGUF block decoding against the gguf package, the
block matmul against x @ dequantize(W).T, and the per-token ops against the torch paths of models/layers.py."""
import numpy as np
import pytest
import torch
import torch.nn.functional as F

from engine.kernels import cpu_gguf, cpu_layers
from engine.models.layers import Rope, causal_attention, rms_norm_reference
from engine.models.spec import RopeSpec
from engine.quant.gguf_blocks import GGUFWeight, concat, dequantize, from_blocks

from .conftest import rel_error

gguf = pytest.importorskip("gguf")
Q = gguf.GGMLQuantizationType
if not cpu_gguf.available():
    pytest.skip("no C compiler: the CPU kernels are not built here", allow_module_level=True)
TYPES = [Q.Q4_0, Q.Q4_1, Q.Q8_0, Q.Q4_K, Q.Q5_K, Q.Q6_K]


def random_blocks(qtype, rows: int, k: int, seed: int = 0) -> np.ndarray:
    """Random codes and scales with finite fp16 scale fields, as [rows, bytes per row]."""
    rng = np.random.default_rng(seed)
    values, size = gguf.GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, (rows, k // values, size), dtype=np.uint8)
    halves = {Q.Q4_0: (0,), Q.Q8_0: (0,), Q.Q4_1: (0, 2), Q.Q4_K: (0, 2), Q.Q5_K: (0, 2), Q.Q6_K: (208,)}[qtype]
    for at in halves:
        scale = rng.uniform(-0.05, 0.05, raw.shape[:2]).astype(np.float16)
        raw[..., at:at + 2] = scale.view(np.uint8).reshape(*raw.shape[:2], 2)
    return raw.reshape(rows, -1)


@pytest.mark.parametrize("qtype", TYPES, ids=lambda q: q.name)
def test_rows_decode_bit_for_bit_as_the_gguf_package(qtype):
    raw = random_blocks(qtype, 24, 512, int(qtype))
    want = gguf.quants.dequantize(raw, qtype).astype(np.float32)
    w = from_blocks(qtype, torch.from_numpy(raw), 512, torch.float32)
    ids = torch.tensor([5, 0, 23, 5])
    assert np.array_equal(cpu_gguf.rows(w, ids).numpy().view(np.uint32), want[ids.numpy()].view(np.uint32))
    assert np.array_equal(dequantize(w).numpy().view(np.uint32), want.view(np.uint32))


@pytest.mark.parametrize("qtype", TYPES, ids=lambda q: q.name)
# decode, verify, the most one call of the dot products takes, several verify steps, prefill-sized
@pytest.mark.parametrize("rows", [1, 3, 16, 40, 80])
def test_linear_matches_the_reference(qtype, rows):
    w = from_blocks(qtype, torch.from_numpy(random_blocks(qtype, 72, 768, rows)), 768, torch.float32)
    x = torch.randn(rows, 768, generator=torch.Generator().manual_seed(rows)) * torch.logspace(-1, 1, 768)
    got, want = cpu_gguf.linear(x, w), cpu_gguf.linear_reference(x.double(), w)
    assert got.shape == (rows, 72) and got.dtype == torch.float32
    # fp32 rounding (the legacy types' x as two int16 planes is finer than that); one int16 plane gave 2-4e-5
    assert rel_error(got, want) < 2e-6
    if rows <= cpu_gguf.STEP_ROWS:  # each row as it is alone
        assert torch.equal(got[-1:], cpu_gguf.linear(x[-1:], w))


def test_fused_parts_of_several_types():
    """A fused projection of Q4_K, Q6_K and plain float rows (a Q4_K_M file's q/k/v): one output, the parts side
    by side; neighbouring parts of one type join into one range."""
    a, b, c = (from_blocks(q, torch.from_numpy(random_blocks(q, 32, 256, i)), 256, torch.float32)
               for i, q in enumerate((Q.Q4_K, Q.Q6_K, Q.Q6_K)))
    plain = torch.randn(16, 256)
    fused = concat([a, b, c, plain])
    assert isinstance(fused, GGUFWeight) and [p.qtype for p in fused.parts] == [Q.Q4_K, Q.Q6_K, Q.F32]
    assert fused.shape == (112, 256)
    x = torch.randn(2, 256)
    want = torch.cat([cpu_gguf.linear(x, a), cpu_gguf.linear(x, b), cpu_gguf.linear(x, c), x @ plain.T], dim=-1)
    assert rel_error(cpu_gguf.linear(x, fused), want) < 1e-6
    ids = torch.tensor([0, 40, 100, 111])
    assert torch.equal(cpu_gguf.rows(fused, ids), dequantize(fused)[ids])


def test_loader_falls_back_to_dequantized_weights_without_the_kernels(tmp_path, monkeypatch):
    from engine.loaders import load_model

    path = tmp_path / "t.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    for key, value in (("block_count", 1), ("embedding_length", 64), ("feed_forward_length", 64),
                       ("attention.head_count", 2)):
        w.add_uint32(f"llama.{key}", value)
    w.add_tokenizer_model("gpt2")
    w.add_token_list([chr(ord("a") + i % 26) * (1 + i // 26) for i in range(32)])
    data = np.random.default_rng(0).standard_normal((32, 64)).astype(np.float32)
    w.add_tensor("token_embd.weight", gguf.quants.quantize(data, Q.Q8_0), raw_dtype=Q.Q8_0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    blocks = load_model(str(path), torch.float32, torch.device("cpu")).weights["embed_tokens.weight"]
    monkeypatch.setattr(cpu_gguf, "available", lambda: False)
    plain = load_model(str(path), torch.float32, torch.device("cpu")).weights["embed_tokens.weight"]
    assert isinstance(blocks, GGUFWeight) and isinstance(plain, torch.Tensor)
    assert torch.equal(dequantize(blocks), plain)


def test_a_kept_library_that_does_not_load_is_built_again(tmp_path, monkeypatch):
    """A truncated file in the kernels' folder (a full disk, a killed copy) is replaced, not taken as a machine
    without a compiler (which would leave every GGUF weight dequantized for the process)."""
    from engine.kernels import cpu_build

    first, second = tmp_path / "a", tmp_path / "b"
    monkeypatch.setitem(cpu_build._state, "dir", first)
    cpu_build._build(cpu_build.SOURCE)
    (built,) = first.glob("cpu_kernels-*.so")
    second.mkdir()
    kept = second / built.name  # another folder: the process has the first file loaded already
    kept.write_bytes(b"\x7fELF truncated")
    machine = built.stem.split("-")[1]
    stale = [second / f"cpu_kernels-{machine}-0123456789abcdef.so", second / f"cpu_gguf-{machine}-0123456789abcdef.so"]
    for path in stale:  # earlier sources' builds on this machine: the rebuild removes them
        path.write_bytes(b"old")
    monkeypatch.setitem(cpu_build._state, "dir", second)
    lib = cpu_build._build(cpu_build.SOURCE)
    assert kept.stat().st_size > 1000 and hasattr(lib, "ninfer_gguf_row_bytes")
    assert not any(path.exists() for path in stale)


def test_a_build_removes_only_this_machines_stale_builds(tmp_path, monkeypatch):
    """A folder shared by machines (a home directory on several hosts, another CPU's flags, another compiler): a
    build removes this machine's builds of other sources and keeps every other machine's, which it cannot load
    and they still use. The compiler and the loader stand in: the names are what is checked."""
    from pathlib import Path
    from types import SimpleNamespace

    from engine.kernels import cpu_build

    monkeypatch.setitem(cpu_build._state, "dir", tmp_path)
    monkeypatch.setattr(cpu_build, "_compile", lambda compiler, source, out: out.write_bytes(b"built"))
    monkeypatch.setattr(cpu_build, "ctypes", SimpleNamespace(CDLL=lambda path: path))
    monkeypatch.setattr(cpu_build, "_cpu_flags", lambda: "flags : fpu sse2 avx2")
    path = Path(cpu_build._build(cpu_build.SOURCE))
    machine = path.stem.split("-")[1]
    stale = [tmp_path / f"{stem}-{machine}-0123456789abcdef.so" for stem in ("cpu_kernels", "cpu_gguf")]
    for old in stale:  # earlier sources' builds on this machine
        old.write_bytes(b"old")
    monkeypatch.setattr(cpu_build, "_cpu_flags", lambda: "flags : fpu sse2 avx2 avx512f")  # another host's CPU
    other = Path(cpu_build._build(cpu_build.SOURCE))
    assert other != path and path.read_bytes() == b"built" and all(old.exists() for old in stale)
    monkeypatch.setattr(cpu_build, "_cpu_flags", lambda: "flags : fpu sse2 avx2")
    path.unlink()  # this machine builds again (its sources changed, say)
    assert Path(cpu_build._build(cpu_build.SOURCE)) == path
    assert not any(old.exists() for old in stale) and other.read_bytes() == b"built"


@pytest.mark.parametrize("zero_centred", [False, True])
def test_add_rms_norm(zero_centred):
    x, r, w = torch.randn(3, 576) * 4, torch.randn(3, 576), torch.randn(576)
    total, normed = cpu_layers.add_rms_norm(x, r, w, 1e-5, zero_centred)
    assert torch.equal(total, x + r)
    assert rel_error(normed, rms_norm_reference(x + r, w, 1e-5, zero_centred)) < 1e-6
    assert torch.equal(cpu_layers.add_rms_norm(x, None, w, 1e-5, zero_centred)[0], x)


def test_rope_on_a_fused_projections_rows():
    rope = Rope(RopeSpec(theta=1e5, rotary_dim=16), 64, torch.device("cpu"))
    cos, sin = rope.cos_sin(torch.tensor([5, 6, 7]), torch.float32)
    qkv = torch.randn(3, 9 * 64 + 128)
    q = qkv[:, :9 * 64].reshape(3, 9, 64)  # rows 704 floats apart
    rot, rest = q[..., :16], q[..., 16:]
    want = torch.cat([rot * cos[:, None] + torch.cat([-rot[..., 8:], rot[..., :8]], -1) * sin[:, None], rest], -1)
    assert torch.equal(cpu_layers.rope(q, cos, sin, 16), want)  # the same products and sums, rounded alike


@pytest.mark.parametrize("t,start,heads,kv_heads", [(1, 300, 9, 3), (5, 40, 4, 4), (1, 0, 2, 1), (16, 600, 8, 2)])
def test_attention(t, start, heads, kv_heads):
    g = torch.Generator().manual_seed(t + start)
    q = torch.randn(t, heads, 64, generator=g)
    k, v = torch.randn(start + t, kv_heads, 64, generator=g) * 2, torch.randn(start + t, kv_heads, 64, generator=g)
    assert rel_error(cpu_layers.attention(q, k, v, start, 0.125), causal_attention(q, k, v, start, 0.125)) < 1e-6


def test_silu_mul():
    gu = torch.randn(2, 3072) * 3
    assert rel_error(cpu_layers.silu_mul(gu), F.silu(gu[:, :1536]) * gu[:, 1536:]) < 1e-6


def test_default_model_on_its_blocks_is_close_to_its_dequantized_weights(default_model_path, monkeypatch):
    """SmolLM2's Q4_1/Q8_0 blocks read by the kernels against the same file dequantized to fp32: decode and verify
    steps (the dot products) within 1e-5 of the fp32 logits (measured: max 1.5e-6 over 32 steps), and
    prefill-sized chunks (dequantized in C, then torch's matmul) equal to rounding."""
    from engine import Engine, EngineConfig

    blocks = Engine(EngineConfig(model=default_model_path, device="cpu", dtype="float32"))
    monkeypatch.setattr(cpu_gguf, "available", lambda: False)
    dense = Engine(EngineConfig(model=default_model_path, device="cpu", dtype="float32"))
    assert isinstance(blocks.model.embed, GGUFWeight) and isinstance(dense.model.embed, torch.Tensor)
    ids = torch.tensor(blocks.tokenizer.encode("The printing press begins in the fifteenth century. " * 8))
    assert len(ids) > cpu_gguf.STEP_ROWS
    a, b = blocks.model.new_cache(128), dense.model.new_cache(128)
    with torch.inference_mode():
        assert rel_error(blocks.model.forward(ids, a, all_logits=True), dense.model.forward(ids, b, all_logits=True)) \
            < 1e-5
        for t in range(16):
            tok = torch.tensor([1000 + 37 * t])
            assert rel_error(blocks.model.forward(tok, a), dense.model.forward(tok, b)) < 1e-5
        verify = torch.tensor([5, 6, 7, 8])
        assert rel_error(blocks.model.forward(verify, a, all_logits=True),
                         dense.model.forward(verify, b, all_logits=True)) < 1e-5
