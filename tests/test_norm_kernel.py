"""The fused RMSNorm kernel against the torch reference on random rows, both weight orders: in the Triton
interpreter on the CPU, on a GPU (NINFER_TEST_DEVICE=cuda) in bf16 at the 27B model's widths."""

import torch

from .conftest import gpu_only, interpret, rel_error


def worst_error(device: str, dtype: torch.dtype, widths) -> float:
    from engine.kernels.norm import rms_norm
    from engine.models.layers import rms_norm_reference

    g = torch.Generator(device=device).manual_seed(6)
    worst = 0.0
    for rows, d in widths:
        x = (torch.randn(rows, d, generator=g, device=device) * 3).to(dtype)
        w = (torch.randn(d, generator=g, device=device) * 0.2).to(dtype)
        for zc in (True, False):
            got, want = rms_norm(x, w, 1e-6, zc).float(), rms_norm_reference(x, w, 1e-6, zc).float()
            worst = max(worst, rel_error(got, want))
    return worst


def test_kernel_matches_reference_in_the_interpreter():
    code = ("import torch; from tests.test_norm_kernel import worst_error; "
            "print(worst_error('cpu', torch.float32, [(1, 64), (5, 96), (3, 576)]))")
    assert interpret(code) < 1e-6


@gpu_only
def test_kernel_matches_reference_on_the_gpu():
    # bf16 outputs: one rounding apart at most where the fp32 sums differ in order
    assert worst_error("cuda", torch.bfloat16, [(1, 5120), (8, 5120), (8 * 24, 256), (8 * 48, 128)]) < 4e-3
