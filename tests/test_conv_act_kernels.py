"""The fused conv1d step (causal depthwise conv + SiLU + state update, window kept for rollback) and the SwiGLU
activation kernel against their torch references on random inputs: in the Triton interpreter on the CPU at small
sizes, on a GPU (NINFER_TEST_DEVICE=cuda) at the 27B model's sizes in bf16."""

import torch

from .conftest import gpu_only, interpret, rel_error


def worst_conv_error(device: str, dtype: torch.dtype, channels: int, width: int = 4) -> float:
    from engine.kernels.conv import conv_update_
    from engine.models.gdn import causal_conv1d

    g = torch.Generator(device=device).manual_seed(8)
    worst = 0.0
    for t in (1, 3, 8, 40):  # 40: a prefill chunk, in blocks of tokens with the state copied after
        proj = (torch.randn(t, channels + 40, generator=g, device=device) * 2).to(dtype)
        x = proj[:, 40:]  # a strided slice, as the GDN layer splits its fused projection
        state = torch.randn(width - 1, channels, generator=g, device=device).to(dtype)
        weight = (torch.randn(channels, width, generator=g, device=device) * 0.5).to(dtype)
        want, want_window = causal_conv1d(x, state, weight)
        for keep in (False, True) if t <= 16 else (False,):
            s = state.clone()
            shape = (64, 2) if keep else (128, 4)  # channels per program, warps: another launch shape too
            window = torch.full_like(want_window, float("nan")) if keep else None  # every row must be written
            got = conv_update_(x, s, weight, window, *shape)
            worst = max(worst, rel_error(got, want), rel_error(s, want_window[t:]))
            if keep:
                worst = max(worst, rel_error(window, want_window))
    return worst


def worst_silu_mul_error(device: str, dtype: torch.dtype, shapes) -> float:
    import torch.nn.functional as F

    from engine.kernels.activation import silu_mul

    g = torch.Generator(device=device).manual_seed(9)
    worst = 0.0
    for rows, f in shapes:
        x = (torch.randn(rows, 2 * f, generator=g, device=device) * 3).to(dtype)
        gate, up = x.chunk(2, dim=-1)
        worst = max(worst, rel_error(silu_mul(x), F.silu(gate) * up))
    return worst


def silu_mul_of_partials_mismatch(device: str, dtype: torch.dtype, shapes) -> float:
    """A split-K matmul's fp32 partials into the activation kernel (summed there) against the sum kernel's output
    into it: the largest difference of the outputs and of their int8 rows (the same bits expected)."""
    from engine.kernels.activation import silu_mul
    from engine.kernels.qmatmul import SplitK

    g = torch.Generator(device=device).manual_seed(11)
    worst = 0.0
    for slices, rows, f in shapes:
        parts = torch.randn(slices, rows, 2 * f, generator=g, device=device) * 2
        split = SplitK(parts, dtype, (rows, 2 * f))
        for quant in (None, False, True):
            got, want = silu_mul(split, quant), silu_mul(split.dense(), quant)
            if quant is None:
                worst = max(worst, (got.float() - want.float()).abs().max().item())
            else:
                worst = max(worst, (got.x.float() - want.x.float()).abs().max().item(),
                            (got.codes.int() - want.codes.int()).abs().max().item(),
                            (got.scales - want.scales).abs().max().item())
    return worst


def test_conv_step_matches_reference_in_the_interpreter():
    code = ("import torch; from tests.test_conv_act_kernels import worst_conv_error; "
            "print(max(worst_conv_error('cpu', torch.float32, 96), worst_conv_error('cpu', torch.float32, 300)))")
    assert interpret(code) < 1e-6


def test_silu_mul_matches_reference_in_the_interpreter():
    code = ("import torch; from tests.test_conv_act_kernels import worst_silu_mul_error; "
            "print(worst_silu_mul_error('cpu', torch.float32, [(1, 64), (5, 1100)]))")
    assert interpret(code) < 1e-6


def test_silu_mul_sums_split_k_partials_as_the_sum_kernel_in_the_interpreter():
    code = ("import torch; from tests.test_conv_act_kernels import silu_mul_of_partials_mismatch; "
            "print(silu_mul_of_partials_mismatch('cpu', torch.bfloat16, [(2, 1, 64), (3, 5, 1088)]))")
    assert interpret(code) == 0.0


@gpu_only
def test_kernels_match_reference_on_the_gpu():
    assert worst_conv_error("cuda", torch.bfloat16, 10240) < 4e-3
    assert worst_silu_mul_error("cuda", torch.bfloat16, [(1, 17408), (8, 17408)]) < 4e-3
    assert silu_mul_of_partials_mismatch("cuda", torch.bfloat16, [(2, 1, 17408), (4, 8, 17408)]) == 0.0
