"""The fused Gated DeltaNet recurrent kernel against the torch recurrence on random inputs: in the Triton
interpreter on the CPU at small sizes, on a GPU (NINFER_TEST_DEVICE=cuda) at the 27B model's sizes."""

import pytest
import torch

from .conftest import gpu_only, interpret, rel_error

# (tokens, key heads, value heads, key dim, value dim)
SMALL = [(1, 2, 2, 16, 16), (3, 1, 3, 32, 48), (8, 2, 4, 16, 64)]
REAL = [(1, 16, 48, 128, 128), (8, 16, 48, 128, 128)]


def worst_error(device: str, cases, dtype: torch.dtype = torch.float32) -> float:
    """Largest relative error of outputs, final state and per-step states against the reference, from random
    raw projections (the conv output and b/a in the model's dtype)."""
    from engine.kernels.gdn import gdn_step_
    from engine.models.gdn import GDNHeads, gated_delta_recurrent, gdn_inputs

    g = torch.Generator(device=device).manual_seed(4)
    worst = 0.0

    def rand(*shape):
        return torch.randn(*shape, generator=g, device=device)

    for t, hk, hv, dk, dv in cases:
        heads = GDNHeads(hk, dk, hv, dv)
        mixed = rand(t, 2 * hk * dk + hv * dv).to(dtype)
        b_raw, a_raw = rand(t, hv).to(dtype), (rand(t, hv) * 3).to(dtype)
        neg_a, dt_bias = -rand(hv).exp(), rand(hv)
        state = rand(hv, dk, dv)
        inputs = gdn_inputs(mixed, b_raw, a_raw, neg_a, dt_bias, heads, torch.float32)
        want_o, want_s, want_steps = gated_delta_recurrent(*inputs, state, keep_states=True)
        # (keep per-step states, value columns per program, warps, inputs first): launch shapes and both orders
        for keep, *shape in ((False, 16, 1, True), (True, 16, 1, False), (False, 32, 4, False), (True, 32, 2, True)):
            s = state.clone()
            steps = torch.full_like(want_steps, float("nan")) if keep else None  # every state must be written
            o = gdn_step_(mixed, b_raw, a_raw, neg_a, dt_bias, heads, s, steps, *shape)
            worst = max(worst, rel_error(o, want_o), rel_error(s, want_s),
                        rel_error(steps, want_steps) if keep else 0.0)
    return worst


def test_kernel_matches_reference_in_the_interpreter():
    code = "from tests.test_gdn_kernel import SMALL, worst_error; print(worst_error('cpu', SMALL))"
    assert interpret(code) < 1e-5


@gpu_only
def test_kernel_matches_reference_on_the_gpu():
    assert worst_error("cuda", REAL, torch.bfloat16) < 1e-4


@gpu_only
def test_fla_prefill_matches_the_chunked_reference():
    pytest.importorskip("fla.ops.gated_delta_rule")
    from engine.kernels.gdn import fla_chunked_
    from engine.models.gdn import gated_delta_chunked, l2norm

    g = torch.Generator(device="cuda").manual_seed(5)
    t, h, d = 1000, 48, 128
    q = l2norm(torch.randn(t, h, d, generator=g, device="cuda")) * d ** -0.5
    k = l2norm(torch.randn(t, h, d, generator=g, device="cuda"))
    v = torch.randn(t, h, d, generator=g, device="cuda")
    decay, beta = -torch.rand(t, h, generator=g, device="cuda") * 0.1, torch.rand(t, h, generator=g, device="cuda")
    state = torch.randn(h, d, d, generator=g, device="cuda") * 0.1
    want_o, want_s = gated_delta_chunked(q, k, v, decay, beta, state.clone())
    s = state.clone()
    o = fla_chunked_(q, k, v, decay, beta, s)
    assert rel_error(o, want_o) < 1e-2
    assert rel_error(s, want_s) < 1e-2
