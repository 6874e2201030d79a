"""Group-wise q8/q5/q4 weights: packing round trip, the Triton kernels against their torch reference (interpreter
on CPU; a GPU at real widths with NINFER_TEST_DEVICE=cuda), the engine on quantized weights against fp32, and the
memory plan's byte count against what is allocated."""

import pytest
import torch

from engine import Engine, EngineConfig
from engine.config import WeightFormats
from engine.quant.qweight import GROUP, codes_of, dequantize, quantize

from .conftest import gpu_only, interpret, rel_error


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
    for n, k, sms in ((80, 192, 4), (64, 512, 4), (64, 2048, 4), (64, 1024, 1)):
        q = quantize(torch.randn(n, k, generator=g), fmt)
        for m in (1, 5, 8):
            x = torch.randn(m, k, generator=g)
            b = qlinear_reference(x, q)
            for split in (False, True):  # the activation quantizer's kernel against its reference, exactly
                a, r = quantize_rows(x, split), quantize_rows_reference(x, split)
                assert all(torch.equal(u, v) for u, v in zip(a, r)), split
            b_int8 = int8_rows_reference(x, q)  # v7/v8 multiply int8 activations: the rows they stand for
            for c in candidates(n, k, sms, fmt, m):  # every version and tile that serves m rows
                a = launch(x, q, c)
                worst = max(worst, rel_error(a, b_int8 if c.int8_rows else b))
                if c.int8_rows:
                    assert rel_error(a, b) < 1.5e-2  # int8 rows vs the float ones
            chosen = choose(x.shape[0], x.dtype, x.device, q)
            worst = max(worst, rel_error(qlinear(x, q), b_int8 if chosen.int8_rows else b))  # the chosen one
print(worst)
"""


def test_triton_kernel_matches_reference_in_the_interpreter():
    assert interpret(KERNEL_CHECK) < 5e-5



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
