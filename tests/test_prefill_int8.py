"""Prefill matmuls on int8 tensor cores (engine/kernels/qgemm.py): the kernel against the reference on the int8
rows it multiplies, in the Triton interpreter on the CPU at small sizes and at the 27B model's widths on a GPU
(NINFER_TEST_DEVICE=cuda, every tile), compiled for the users' GPUs without one; the choice between it and
dequantize + cuBLAS; a model's logits with the int8 prefill against the reference of what it computes and the
dequantized path."""

import re

import pytest
import torch

from engine.quant.qweight import quantize, tile

from .conftest import compile_ahead, gpu_only, interpret, rel_error

KERNEL_CHECK = """
import torch
from engine.kernels import qgemm
from engine.kernels.actquant import quantize_rows_reference
from engine.kernels.qmatmul import int8_rows_reference, qlinear_reference
from engine.quant.qweight import quantize, tile
from tests.conftest import rel_error
g = torch.Generator().manual_seed(4)
worst = 0.0
# N and M not multiples of the tiles (rows past the ends read and never stored), K of four groups; the first tile
# runs two programs each way, the second (row-major q8, tiled q5) one program wider than the weight and x
small, wide = qgemm.GemmConfig("int8_gemm", 64, 32, 4, 2), qgemm.GemmConfig("int8_gemm", 128, 64, 4, 2)
for fmt in ("q8", "q5", "q4"):
    q = quantize(torch.randn(96, 256, generator=g), fmt)
    x = torch.randn(40, 256, generator=g)
    # x's int8 rows exactly as actquant's, each group's scale and code sum written column-wise
    codes, scales, bias = qgemm.int8_rows(x, fmt, 64)
    ref_codes, ref_scales, ref_sums = quantize_rows_reference(x, fmt != "q8")
    offset = {"q8": 0, "q5": 16, "q4": 8}[fmt]
    assert torch.equal(codes[:40], ref_codes) and torch.equal(scales[:, :40], ref_scales.t())
    assert torch.equal(bias[:, :40], 12582912.0 + offset * ref_sums.t().float())
    assert not codes[40:].any()  # padding rows: zeros
    want, want_float = int8_rows_reference(x, q), qlinear_reference(x, q)
    for w in (q, tile(q)) if fmt != "q8" else (q,):
        for cfg in (small, wide) if (fmt, w.tiled) in (("q8", False), ("q5", True)) else (small,):
            got = qgemm.launch(x, w, cfg)
            worst = max(worst, rel_error(got, want))
            assert rel_error(got, want_float) < 1.5e-2  # int8 rows vs the float ones
    assert qgemm.choose(40, x.dtype, x.device, q) == qgemm.DEQUANT  # off a GPU the dequantized path stays
print(worst)
"""


def test_int8_prefill_kernel_in_the_interpreter():
    """Every format, both layouts, two tiles: the rows it multiplies exactly as actquant's, the product to fp32
    rounding."""
    assert interpret(KERNEL_CHECK) < 1e-5


def test_int8_prefill_kernel_compiles_for_the_users_gpus():
    """Compiled for sm_89 and sm_90 as a launch specializes it: int8 tensor-core instructions (mma.sync on the RTX
    4090, wgmma on Hopper), codes and x through cp.async in vectors (the tiled layout's row runs in 8 bytes), no
    byte loads (the byte gathers of an earlier fused prefill kernel cost it 1.7-14x, NOTES.md (15))."""
    from engine.kernels import qgemm

    kernel = qgemm._build()["int8_gemm"]
    names = ("xq_ptr", "xs_ptr", "bias_ptr", "codes_ptr", "high_ptr", "scales_ptr", "out_ptr", "M", "M_PAD", "N", "K",
             "code_stride", "high_stride", "scale_stride")
    # Hopper in every format and layout; the RTX 4090 in the two that differ most (each compilation costs CI time)
    for fmt, tiled, archs in ((8, False, (90,)), (5, False, (90,)), (4, False, (89, 90)), (5, True, (89, 90)),
                              (4, True, (90,))):
        types = ("*i8", "*fp32", "*fp32", "*i8" if fmt == 8 else "*u8", "*u8", "*bf16", "*bf16") + ("i32",) * 7
        consts = {"FMT": fmt, "TILED": tiled, "BLOCK_N": 128, "BLOCK_M": 64, "USE_ASM": True}
        for arch, ptx in zip(archs, compile_ahead(kernel, dict(zip(names, types, strict=True)), consts, archs,
                                                  aligned=tuple(n for n in names if n != "M")), strict=True):
            assert ("wgmma.mma_async" if arch == 90 else "mma.sync.aligned.m16n8k32") in ptx, (fmt, tiled, arch)
            assert not re.findall(r"ld\.global\.(?:v\d\.)?[bsu]8", ptx), (fmt, tiled, arch)
            copies = set(re.findall(r"cp\.async\.\w+\.shared\.global \[[^\]]*\], \[[^\]]*\], (0x\w+|\d+)", ptx))
            assert copies and copies <= {"0x10", "0x8", "0x4"}, (fmt, tiled, arch, copies)
            assert "0x10" in copies, (fmt, tiled, arch)


def rows_reference(x: torch.Tensor, w) -> torch.Tensor:
    """The reference on the int8 rows `qgemm.int8_rows` makes on this device. On a GPU they may differ from
    actquant's torch reference by one code in a rare element (Triton divides with div.full and fuses the rounding's
    multiply-add), as the decode kernels' rows (`rowquant`) do: the matmul is checked on the rows it was given."""
    from engine.kernels import qgemm
    from engine.kernels.actquant import dequantize_rows
    from engine.kernels.qmatmul import qlinear_reference

    codes, scales, _ = qgemm.int8_rows(x, w.fmt, x.shape[0])
    return qlinear_reference(dequantize_rows(codes, scales.t(), w.fmt != "q8"), w)


@gpu_only
def test_int8_prefill_kernel_on_the_gpu():
    """The 27B's prefill shapes at 512 and 2048 rows, both layouts, every tile, against the reference on the int8
    rows it multiplies (in bf16, and one shape in fp32 to its rounding), those rows near actquant's; then the chosen
    path through `qlinear`."""
    from engine.kernels import qgemm
    from engine.kernels.actquant import quantize_rows_reference
    from engine.kernels.qmatmul import qlinear, qlinear_reference

    g = torch.Generator(device="cuda").manual_seed(9)
    tiles = [c for c in qgemm.candidates() if c.kernel == "int8_gemm"]
    weights = {}
    for n, k, fmt in ((17408, 5120, "q4"), (5120, 17408, "q4"), (16480, 5120, "q5"), (1040, 5120, "q8")):
        q = quantize(torch.randn(n, k, generator=g, device="cuda", dtype=torch.bfloat16), fmt)
        weights[n, k] = q
        for m in (512, 2048) if fmt != "q8" else (300,):
            x = torch.randn(m, k, generator=g, device="cuda", dtype=torch.bfloat16)
            codes, scales, _ = qgemm.int8_rows(x, fmt, m)
            ref_codes, ref_scales, _ = quantize_rows_reference(x, fmt != "q8")
            off = (codes.int() - ref_codes.int()).abs()
            assert off.max() <= 1 and (off > 0).float().mean() < 1e-3, (fmt, m)
            assert rel_error(scales.t(), ref_scales) < 1e-6
            want = rows_reference(x, q)
            for w in (q, tile(q)) if fmt != "q8" else (q,):
                for c in tiles:
                    got = qgemm.launch(x, w, c)
                    assert got.dtype == x.dtype and rel_error(got, want) < 8e-3, (n, k, fmt, m, w.tiled, c)
    gate_up = weights[17408, 5120]
    x = torch.randn(333, 5120, generator=g, device="cuda")
    want = rows_reference(x, gate_up)
    for w in (gate_up, tile(gate_up)):
        assert rel_error(qgemm.launch(x, w, tiles[0]), want) < 1e-5
        assert rel_error(qgemm.launch(x, w, tiles[-1]), want) < 1e-5
    # the path and tile chosen by timing, through the engine's entry point
    x = torch.randn(2048, 5120, generator=g, device="cuda", dtype=torch.bfloat16)
    want = qlinear_reference(x, gate_up)
    for w in (gate_up, tile(gate_up)):
        assert rel_error(qlinear(x, w), want) < 1.5e-2
        assert qgemm.choose(2048, x.dtype, x.device, w) in qgemm.candidates(2048)


@gpu_only
@pytest.mark.parametrize("layout", ["rows", "tiles"])
def test_int8_prefill_in_a_model_on_the_gpu(monkeypatch, layout):
    """A hybrid model's 300-token prefill and the decode step after it (fp32, q5/q4 weights), its prefill matmuls on
    the int8 kernel, on the reference on the same int8 rows, and dequantized: the kernel's logits sit as far from
    the dequantized path's as the reference's do, and nearer the reference's than that. Not to fp32 rounding: each
    matmul's input is rounded to int8 again, so the kernel's 1e-7 differences flip a few codes in the next layer's
    rows, which this random model spreads (in the interpreter at 300 tokens: kernel vs reference 1.2e-2 and 7e-3,
    either vs the dequantized path 5.4e-2 and 2.4e-2)."""
    from engine import Engine, EngineConfig
    from engine.config import WeightFormats
    from engine.kernels import qgemm
    from engine.models.presets import PRESETS, TINY

    monkeypatch.setitem(PRESETS, "prefill-int8-test", {**TINY, "hidden_size": 512, "intermediate_size": 1024})
    ids = torch.randint(0, 256, (301,), generator=torch.Generator().manual_seed(8))
    launch = qgemm.launch
    int8 = qgemm.GemmConfig("int8_gemm", 64, 64, 4, 4)
    paths = {"int8": lambda x, w, cfg: launch(x, w, int8),
             "reference": lambda x, w, cfg: rows_reference(x, w).to(x.dtype),
             "dequant": lambda x, w, cfg: launch(x, w, qgemm.DEQUANT)}
    logits = {}
    monkeypatch.setattr(qgemm, "choose", lambda rows, dtype, device, w: qgemm.DEQUANT)  # no timing: `paths` pick
    for name, path in paths.items():
        monkeypatch.setattr(qgemm, "launch", path)
        eng = Engine(EngineConfig("synthetic:prefill-int8-test", device="cuda", dtype="float32", weight_layout=layout,
                                  weights=WeightFormats(attn="q5", gdn="q5", mlp="q4"), cuda_graphs=False))
        m = eng.model
        assert m.layers[0]["gate_up"].tiled == (layout == "tiles")
        cache = m.new_cache(320)
        with torch.inference_mode():
            prefill = m.forward(ids[:300].cuda(), cache)
            step = m.forward(ids[300:].cuda(), cache)
        logits[name] = (prefill.float(), step.float())

    def errors(a: str, b: str) -> list[float]:
        return [rel_error(u, v) for u, v in zip(logits[a], logits[b], strict=True)]

    drift, own, gap = errors("int8", "dequant"), errors("reference", "dequant"), errors("int8", "reference")
    assert all(d < 1.5 * o + 1e-3 for d, o in zip(drift, own, strict=True)), (drift, own)
    assert all(g < 0.75 * o for g, o in zip(gap, own, strict=True)), (gap, own)
    assert max(drift) < 0.2, drift


def test_a_tile_that_computes_wrongly_is_never_chosen(monkeypatch):
    """A GPU could miscompute an int8 tile: the choice checks each tile's product row by row against the dequantized
    path's before it times those that agree, and passes over one that is off or cannot run, however fast."""
    from engine.kernels import qgemm

    g = torch.Generator().manual_seed(3)
    x, want = torch.randn(8, 64, generator=g), torch.randn(8, 16, generator=g)
    tile, other = [c for c in qgemm.candidates(8) if c != qgemm.DEQUANT][:2]
    monkeypatch.setattr(qgemm, "launch", lambda x, w, cfg: want + 1e-3 * torch.randn(want.shape, generator=g))
    assert qgemm._agrees(x, None, tile, want)  # x's int8 rounding: close
    wrong_row = want.clone()
    wrong_row[5] *= -1
    monkeypatch.setattr(qgemm, "launch", lambda x, w, cfg: wrong_row)
    assert not qgemm._agrees(x, None, tile, want)  # one row of eight off: the whole is 35% off, that row 200%
    monkeypatch.setattr(qgemm, "launch", lambda x, w, cfg: (_ for _ in ()).throw(RuntimeError("no compile")))
    assert not qgemm._agrees(x, None, tile, want) and qgemm._agrees(x, None, qgemm.DEQUANT, want)
    times = {qgemm.DEQUANT: 2.0, tile: 1.0, other: float("inf")}
    assert qgemm.fastest([qgemm.DEQUANT, tile, other], times.get) == tile
    assert qgemm.fastest([qgemm.DEQUANT, other], times.get) == qgemm.DEQUANT
    assert qgemm.fastest([other], times.get) == qgemm.DEQUANT  # nothing finite: the dequantized path


def test_a_candidate_that_breaks_the_device_stops_the_choice(monkeypatch):
    """A compile failure makes a candidate infinitely slow; a CUDA error (sticky: every candidate after it would
    fail too, and the untimed first one be chosen and kept) propagates, as running out of memory does."""
    from engine.kernels import timing
    from engine.kernels.timing import candidate_ms

    monkeypatch.setattr(timing, "graph_ms", lambda fn, **_: fn())  # the call itself, as on a GPU

    def fails(message: str):
        def fn():
            raise RuntimeError(message)
        return fn

    assert candidate_ms(fails("out of shared memory")) == float("inf")
    with pytest.raises(RuntimeError, match="CUDA error"):
        candidate_ms(fails("CUDA error: an illegal memory access was encountered"))
