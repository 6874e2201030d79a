"""Group-wise q8/q5/q4 weights: packing round trip, the Triton kernels against their torch reference (interpreter
on CPU; a GPU at real widths with NINFER_TEST_DEVICE=cuda), the engine on quantized weights against fp32, and the
memory plan's byte count against what is allocated."""

import ctypes

import pytest
import torch

from engine import Engine, EngineConfig, nvrtc
from engine.config import WeightFormats
from engine.quant.qweight import GROUP, codes_of, concat_rows, dequantize, first_rows, quantize, tile, untile

from .conftest import compile_ahead, gpu_only, interpret, rel_error

needs_nvrtc = pytest.mark.skipif(nvrtc.version() is None, reason="no NVRTC here (a CPU build of torch)")


@pytest.mark.parametrize("fmt,qmax,bound", [("q8", 127, 0.008), ("q5", 15, 0.06), ("q4", 7, 0.12)])
def test_round_trip(fmt, qmax, bound):
    g = torch.Generator().manual_seed(1)
    w = torch.randn(48, 4 * GROUP, generator=g) * torch.linspace(0.1, 3, 4 * GROUP)  # groups of unequal range
    q = quantize(w, fmt)
    codes = codes_of(q)
    assert int(codes.max()) == qmax and int(codes.min()) >= -qmax - 1
    err = ((dequantize(q) - w).norm() / w.norm()).item()
    assert err < bound, err
    # the codes are the nearest grid points of each group
    grid = codes.float().reshape(48, 4, GROUP) * q.scales.float()[..., None]
    assert torch.allclose(grid.reshape(48, -1), dequantize(q), atol=0)


@pytest.mark.parametrize("fmt,tiled", [("q8", False), ("q5", False), ("q5", True), ("q4", True)])
def test_first_rows_are_the_weight_s_first_rows(fmt, tiled):
    """A drafter's restricted LM head: a view of the first rows, in either layout."""
    q = quantize(torch.randn(64, 4 * GROUP, generator=torch.Generator().manual_seed(2)), fmt)
    w = tile(q) if tiled else q
    head = first_rows(w, 32)
    assert head.shape == (32, 4 * GROUP) and head.codes.data_ptr() == w.codes.data_ptr()  # a view: no copy
    assert torch.equal(dequantize(untile(head)), dequantize(q)[:32])
    w = torch.randn(64, 8)
    assert torch.equal(first_rows(w, 32), w[:32])


@pytest.mark.parametrize("fmt", ["q4", "q5"])
def test_tiled_layout(fmt):
    """The tiled layout holds what the tiled kernels' lanes load (the order their docstring states, written here
    index by index), and every reader of a tiled weight gets what it gets from the row-major one."""
    g = torch.Generator().manual_seed(4)
    q = quantize(torch.randn(48, 4 * GROUP, generator=g), fmt)
    t = tile(q)
    assert t.tiled and t.nbytes == q.nbytes and t.shape == q.shape
    for r in range(3):
        for gi in range(4):
            for lane in range(32):
                gid, tid = divmod(lane, 4)
                for j in range(16):  # bytes 8tid..8tid+7 of the group's 32, row gid then row gid + 8
                    row = 16 * r + gid + 8 * (j // 8)
                    assert t.codes[r, gi, 16 * lane + j] == q.codes[row, 32 * gi + 8 * tid + j % 8]
                if fmt == "q5":  # the fifth bits of those bytes' codes: bytes 2tid, 2tid + 1 of the group's 8
                    for j in range(4):
                        row = 16 * r + gid + 8 * (j // 2)
                        assert t.high[r, gi, 4 * lane + j] == q.high[row, 8 * gi + 2 * tid + j % 2]
            assert torch.equal(t.scales[r, gi], q.scales[16 * r:16 * r + 16, gi])
    back = untile(t)
    assert not back.tiled and torch.equal(back.codes, q.codes) and torch.equal(back.scales, q.scales)
    assert torch.equal(dequantize(t), dequantize(q)) and torch.equal(codes_of(t), codes_of(q))
    ids = torch.tensor([0, 17, 47, 17, 8])
    assert torch.equal(t.rows(ids), q.rows(ids))
    x = torch.randn(3, 4 * GROUP, generator=g)
    assert torch.equal(t.matmul(x), q.matmul(x))  # the CPU takes the reference, through untile
    # fused projections: tiled parts stack as tiles; a part too short to tile makes the whole row-major
    p = quantize(torch.randn(32, 4 * GROUP, generator=g), fmt)
    both = concat_rows([t, tile(p)])
    assert both.tiled and torch.equal(dequantize(both), dequantize(concat_rows([q, p])))
    short = quantize(torch.randn(8, 4 * GROUP, generator=g), fmt)
    mixed = concat_rows([t, short])
    assert not mixed.tiled and torch.equal(dequantize(mixed), dequantize(concat_rows([q, short])))


KERNEL_CHECK = """
import torch
from engine.quant.qweight import quantize
from engine.kernels.actquant import quantize_rows, quantize_rows_reference
from engine.kernels.qmatmul import candidates, choose, int8_rows_reference, launch, qlinear, qlinear_reference
from tests.conftest import rel_error
g = torch.Generator().manual_seed(2)
worst = 0.0
for fmt in ("q8", "q5", "q4"):
    # the last two split K; the last, sized for a 1-SM GPU, also runs several loop iterations per K-slice in every
    # tile (the kernels carry loads from one iteration into the next)
    for n, k, sms in ((80, 192, 4), (64, 512, 4), (64, 1024, 4), (64, 1024, 1)):
        q = quantize(torch.randn(n, k, generator=g), fmt)
        for m in (1, 5):  # the one-row tiles; the 2-16-row ones (the same for every count), rows past 5 masked
            x = torch.randn(m, k, generator=g)
            b = qlinear_reference(x, q)
            for split in (False, True):  # the activation quantizer's kernel against its reference, exactly
                a, r = quantize_rows(x, split), quantize_rows_reference(x, split)
                assert all(torch.equal(u, v) for u, v in zip(a, r)), split
            b_int8 = int8_rows_reference(x, q)  # int8-row kernels multiply these: the rows they stand for
            chosen = choose(x.shape[0], x.dtype, x.device, q)
            tiles = candidates(n, k, sms, fmt, m)  # every kernel and tile that serves m rows
            # the chosen one through qlinear, in the candidates' place where it is one of them (the same launch)
            for c in tiles + ([] if chosen in tiles else [chosen]):
                a = qlinear(x, q) if c == chosen else launch(x, q, c)
                worst = max(worst, rel_error(a, b_int8 if c.int8_rows else b))
                if c.int8_rows:
                    assert rel_error(a, b) < 1.5e-2  # int8 rows vs the float ones
print(worst)
"""


@pytest.mark.slow
def test_triton_kernel_matches_reference_in_the_interpreter():
    assert interpret(KERNEL_CHECK) < 5e-5



DEQUANT_CHECK = """
import torch
from engine.kernels import dequant
from engine.kernels.qmatmul import qlinear, qlinear_reference
from engine.quant.qweight import dequantize, quantize, tile, tileable
from tests.conftest import rel_error
g = torch.Generator().manual_seed(6)
dequant.SCRATCH_ELEMENTS = 32 * 256  # blocks of 32 rows: the matmul runs in three blocks, the last one short
worst = 0.0
for fmt, k in (("q8", 192), ("q5", 256), ("q4", 256), ("q4", 384), ("q5", 192)):  # programs of 64-256 columns
    q = quantize(torch.randn(80, k, generator=g), fmt)
    for w in (q, tile(q)) if tileable(q) else (q,):
        for start, stop in ((0, 80), (16, 48)):  # codes and scales exactly as the reference makes them
            assert torch.equal(dequant.dequantize_rows(w, start, stop, torch.float32), dequantize(q)[start:stop])
        x = torch.randn(20, k, generator=g)  # more rows than the fused kernels take
        worst = max(worst, rel_error(qlinear(x, w), qlinear_reference(x, q)))
print(worst)
"""


def test_prefill_dequant_kernel_matches_reference_in_the_interpreter():
    """Both layouts, every format: the rows exactly, the blocked matmul to fp32 rounding."""
    assert interpret(DEQUANT_CHECK) < 1e-6


def test_prefill_dequant_kernel_loads_vectors_on_the_users_gpus():
    """Compiled for sm_89 and sm_90 as a launch on aligned tensors specializes it: every layout's codes arrive in
    vector loads, not byte by byte (the byte gathers of the kernel before cost 1.8-4.6x, NOTES.md (15)/(20))."""
    import re

    from engine.kernels import dequant

    kernel = dequant._build()
    names = ("codes_ptr", "high_ptr", "scales_ptr", "out_ptr", "row0", "K")
    for fmt, tiled in ((8, False), (5, False), (4, False), (5, True), (4, True)):
        sig = dict(zip(names, ("*i8" if fmt == 8 else "*u8", "*u8", "*bf16", "*bf16", "i32", "i32"), strict=True))
        for ptx in compile_ahead(kernel, sig, {"FMT": fmt, "TILED": tiled, "BLOCK_C": 256}, aligned=names):
            loads = re.findall(r"ld\.global\.(\S+)", ptx)
            assert not [w for w in loads if w.startswith(("b8", "u8", "s8"))], (fmt, tiled, loads)
            assert [w for w in loads if w.startswith(("v2", "v4"))], (fmt, tiled, loads)
            assert len(re.findall(r"st\.global\.v4", ptx)) == 4, (fmt, tiled)


@gpu_only
def test_prefill_dequant_kernel_on_the_gpu():
    from engine.kernels.dequant import dequantize_rows
    from engine.kernels.qmatmul import qlinear, qlinear_reference

    g = torch.Generator(device="cuda").manual_seed(7)
    for fmt in ("q8", "q5", "q4"):
        q = quantize(torch.randn(17408 * 2, 5120, generator=g, device="cuda", dtype=torch.bfloat16), fmt)
        x = torch.randn(300, 5120, generator=g, device="cuda", dtype=torch.bfloat16)
        want = qlinear_reference(x, q)
        for w in (q, tile(q)) if fmt != "q8" else (q,):
            assert torch.equal(dequantize_rows(w, 4096, 8192, torch.bfloat16), dequantize(q, torch.bfloat16)[4096:8192])
            assert rel_error(qlinear(x, w), want) < 1e-2, fmt


@gpu_only
def test_every_kernel_candidate_on_the_gpu():
    from engine.kernels.qmatmul import candidates, int8_rows_reference, launch, qlinear_reference

    g = torch.Generator(device="cuda").manual_seed(3)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for fmt in ("q8", "q5", "q4"):
        for n, k in ((1024, 5120), (640, 17408)):  # 5120 / 17408: the 27B's widths; K is split for the second
            q = quantize(torch.randn(n, k, generator=g, device="cuda", dtype=torch.bfloat16), fmt)
            for m in (1, 8):
                x = torch.randn(m, k, generator=g, device="cuda", dtype=torch.bfloat16)
                want_int8, want = int8_rows_reference(x, q), qlinear_reference(x.float(), q)
                for c in candidates(n, k, sms, fmt, m):
                    got = launch(x, q, c)
                    assert rel_error(got, want_int8 if c.int8_rows else want) < 8e-3, (fmt, n, k, m, c)


def test_weight_layout_follows_the_spec():
    """"auto" tiles q4/q5 weights for engines whose steps multiply several rows (drafts to verify, or batched
    requests) and keeps them row-major for one-row steps."""
    from engine.config import EngineConfig
    from engine.errors import UserError

    assert not EngineConfig("m").tiled_weights
    assert EngineConfig("m", spec="dflash").tiled_weights
    assert EngineConfig("m", max_concurrency=4, cuda_graphs=False).tiled_weights
    assert EngineConfig("m", max_concurrency=4).tiled_weights  # batch buckets' graphs step several rows
    assert not EngineConfig("m", spec="dflash", weight_layout="rows").tiled_weights
    assert EngineConfig("m", weight_layout="tiles").tiled_weights
    with pytest.raises(UserError, match="weight_layout"):
        EngineConfig("m", weight_layout="columns")


@gpu_only
def test_tiled_kernels_on_the_gpu():
    """The tiled kernels on tiled weights: every candidate, 1-64 rows (`tiled_mma` takes 8 per launch,
    `tiled_mma_streamed` up to 64 in one: several requests' verify rows; 70 rows in two streamed launches), bf16 and
    fp16 scales and outputs, and the K-slice partials a residual norm sums, against the int8-row reference."""
    from engine.kernels import qtiled
    from engine.kernels.qmatmul import MAX_PARTIAL_SLICES, SplitK, candidates, int8_rows_reference, launch, qlinear

    assert qtiled.usable(torch.device("cuda"))
    g = torch.Generator(device="cuda").manual_seed(5)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for fmt in ("q5", "q4"):
        for n, k, dtype in ((1040, 5120, torch.bfloat16), (640, 17408, torch.float16)):
            q = tile(quantize(torch.randn(n, k, generator=g, device="cuda", dtype=dtype), fmt))
            for m in (1, 2, 5, 8, 12, 16, 17, 32, 45, 64, 70):
                x = torch.randn(m, k, generator=g, device="cuda", dtype=dtype)
                want = int8_rows_reference(x, q)
                options = candidates(n, k, sms, fmt, min(m, 64), tiled=True)
                assert options and all(c.tiled for c in options)
                assert any(c.kernel == "tiled_mma_streamed" for c in options) == (m > 8)
                for c in options:
                    got = launch(x, q, c)
                    assert got.dtype == dtype and rel_error(got, want) < 8e-3, (fmt, n, k, m, c)
                    if c.split > 1:  # a residual norm's input: partials, summed already past MAX_PARTIAL_SLICES
                        parts = launch(x, q, c, partial=True)
                        assert isinstance(parts, SplitK) == (c.split <= MAX_PARTIAL_SLICES)
                        assert rel_error(parts.dense() if isinstance(parts, SplitK) else parts, want) < 8e-3
                if m <= 64:
                    assert rel_error(qlinear(x, q), want) < 8e-3


@gpu_only
def test_tiled_weights_in_a_model_on_the_gpu(monkeypatch):
    """The hybrid model with q4/q5 weights tiled (the CUDA kernels) against the same weights row-major, multiplied
    by the int8-row kernels too (a float-row kernel chosen for a tiny shape would skip the activations' int8
    rounding, a different computation): the logits of a decode step and of a verify step agree. The tiny
    preset widened so its projections tile."""
    from engine.config import EngineConfig
    from engine.kernels import qmatmul
    from engine.models.presets import PRESETS, TINY

    chosen = qmatmul.choose

    def int8_rows(rows, dtype, device, w):
        c = chosen(rows, dtype, device, w)
        sms = torch.cuda.get_device_properties(device).multi_processor_count
        options = qmatmul.candidates(w.out_features, w.in_features, sms, w.fmt, rows, w.tiled)
        # a width no int8-row kernel takes (int8_dp4a needs K % 512 == 0) keeps the float one: it is not tiled either
        return c if c.int8_rows else next((o for o in options if o.int8_rows), c)

    monkeypatch.setattr(qmatmul, "choose", int8_rows)
    monkeypatch.setitem(PRESETS, "tiles-test", {**TINY, "hidden_size": 512, "intermediate_size": 1024})
    ids = torch.randint(0, 256, (27,), generator=torch.Generator().manual_seed(8))
    logits = []
    for layout in ("rows", "tiles"):
        eng = Engine(EngineConfig("synthetic:tiles-test", device="cuda", kv_dtype="int8", weight_layout=layout,
                                  weights=WeightFormats(attn="q5", gdn="q5", mlp="q4"), cuda_graphs=False))
        m = eng.model
        assert m.layers[0]["gate_up"].tiled == (layout == "tiles")
        cache = m.new_cache(64)
        with torch.inference_mode():
            m.forward(ids[:20].cuda(), cache)
            one = m.forward(ids[20:21].cuda(), cache)
            verify = m.forward(ids[21:27].cuda(), cache, all_logits=True, keep_inputs=True)
        logits.append((one.float(), verify.float()))
    errors = [rel_error(t, r) for t, r in zip(logits[1], logits[0], strict=True)]
    assert max(errors) < 1e-2, errors  # decode step, verify step


@needs_nvrtc
def test_tiled_kernels_compile_for_the_users_gpus():
    """The tiled kernels' source compiles for the RTX 4090 (sm_89) and the H200 (sm_90) wherever NVRTC is
    present (a CUDA build of torch), GPU or not."""
    from engine.kernels import qtiled

    for arch in ("89", "90"):
        for fmt in ("q4", "q5"):
            # tiled_mma, tiled_dp4a, tiled_dp4a_xreg
            for one_row, x_in_registers in ((False, False), (True, False), (True, True)):
                assert b".entry qtiled" in qtiled.ptx(fmt, 4, 2, 8, one_row, arch == "89", arch, x_in_registers)
            for chunks in (2, 4, 8):  # tiled_mma_streamed
                assert b".entry qtiled" in qtiled.ptx(fmt, 4, 1, 4, False, arch == "89", arch, chunks=chunks)


@needs_nvrtc
def test_tiled_kernels_wait_for_the_kernel_before_under_pdl():
    """Launched with PDL (sm_90+), a tiled kernel may start while the kernel before it runs: it must pass the grid
    dependency wait before it reads x (tiled_mma and tiled_dp4a stage it with cp.async, tiled_dp4a_xreg loads it
    with the weights) or stores, and may only request weights before it. Without PDL (the RTX 4090) there is no
    wait at all."""
    from engine.kernels import qtiled

    for one_row, x_in_registers in ((False, False), (True, False), (True, True)):
        lines = qtiled.ptx("q5", 4, 2, 8, one_row, False, "90", x_in_registers, pdl=True).decode().splitlines()
        wait = next(i for i, line in enumerate(lines) if "griddepcontrol.wait" in line)
        assert any("griddepcontrol.launch_dependents" in line for line in lines[wait:])
        before = lines[:wait]
        assert not any("cp.async" in line or "st.global" in line or "st.shared" in line for line in before)
        weight_loads = sum("ld.global" in line for line in before)
        # tiled_mma/tiled_dp4a: the first UNROLL groups' weights of MT tiles, fifth bits and scales; tiled_dp4a_xreg
        # loads nothing early
        assert weight_loads == (0 if x_in_registers else 2 * 8 + 2 * 8 + 2 * 2 * 2)
        assert b"griddepcontrol" not in qtiled.ptx("q5", 4, 2, 8, one_row, True, "89", x_in_registers)


def test_launch_structs_match_the_driver_abi():
    """cuLaunchKernelEx reads these through ctypes: CUlaunchAttribute is 72 bytes (id, pad, a 64-byte union),
    CUlaunchConfig has the stream at 32, the attributes at 40 and their count at 48 (cuda.h, CUDA 12 and 13)."""
    from engine import cuda_launch

    assert ctypes.sizeof(cuda_launch._Attribute) == 72 and cuda_launch._Attribute.value.offset == 8
    config = cuda_launch._Config
    assert (config.stream.offset, config.attrs.offset, config.count.offset) == (32, 40, 48)


def test_engine_on_quantized_weights(default_model_path):
    base = Engine(EngineConfig(model=default_model_path, device="cpu"))
    ids = base.encode_chat([{"role": "user", "content": "Write a short poem about the sea and the wind."}])
    ref = base.model.forward(torch.tensor(ids), base.model.new_cache(len(ids)), all_logits=True)
    for fmt, bound in (("q8", 0.06), ("q5", 0.4)):
        eng = Engine(EngineConfig(model=default_model_path, device="cpu", weights=WeightFormats.uniform(fmt)))
        out = eng.model.forward(torch.tensor(ids), eng.model.new_cache(len(ids)), all_logits=True)
        assert rel_error(out, ref) < bound
        tensors = [eng.model.embed, eng.model.norm, *(v for layer in eng.model.layers for v in layer.values())]
        assert sum(t.nbytes for t in tensors) == eng.plan.weights  # the plan counts what is allocated
