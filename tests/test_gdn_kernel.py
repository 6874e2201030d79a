"""The fused Gated DeltaNet recurrent kernel against the torch recurrence on random inputs: in the Triton
interpreter on the CPU at small sizes, on a GPU (NINFER_TEST_DEVICE=cuda) at the 27B model's sizes."""

import pytest
import torch

from .conftest import gpu_only, interpret, rel_error

# (tokens, key heads, value heads, key dim, value dim)
SMALL = [(1, 2, 2, 16, 16), (3, 1, 3, 32, 48), (8, 2, 4, 16, 64)]
REAL = [(1, 16, 48, 128, 128), (8, 16, 48, 128, 128)]


def worst_error(device: str, cases, dtype: torch.dtype = torch.float32) -> float:
    """Largest relative error against the reference, from random raw projections (the conv output and b/a in the
    model's dtype): outputs and final state of a step; a verify step's outputs with the state left as it was; and
    the replay of its first tokens into two layers' states at once (one of them a copy of the step's state)."""
    from engine.kernels.gdn import gdn_replay_, gdn_step_
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
        want_o, want_s = gated_delta_recurrent(*inputs, state)
        # (verify: state left, value columns per program, warps, inputs first): launch shapes and both orders
        for frozen, *shape in ((False, 16, 1, True), (True, 16, 1, False), (False, 32, 4, False), (True, 32, 2, True)):
            s = state.clone()
            o = gdn_step_(mixed, b_raw, a_raw, neg_a, dt_bias, heads, s, frozen, *shape)
            worst = max(worst, rel_error(o, want_o), rel_error(s, state if frozen else want_s))
        # the commit of a verify step that kept `keep` of its t tokens, for layer 0; layer 1 has other inputs
        keep = max(1, t - 1)
        other = rand(t, mixed.shape[1]).to(dtype)
        saved = torch.stack([mixed, other])
        gates = torch.stack([torch.stack([b_raw, a_raw]), torch.stack([a_raw, b_raw])])
        rates = torch.stack([neg_a, neg_a * 0.5]), torch.stack([dt_bias, -dt_bias])
        states = torch.stack([state, state.flip(0)])
        gdn_replay_(saved, gates, *rates, heads, states, keep)
        for layer in range(2):
            want = gated_delta_recurrent(*gdn_inputs(saved[layer, :keep], gates[layer, 0, :keep],
                                                     gates[layer, 1, :keep], rates[0][layer], rates[1][layer], heads,
                                                     torch.float32), [state, state.flip(0)][layer])[1]
            worst = max(worst, rel_error(states[layer], want))
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
