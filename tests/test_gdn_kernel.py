"""The fused Gated DeltaNet recurrent kernel against the torch recurrence on random inputs: in the Triton
interpreter on the CPU at small sizes, on a GPU (NINFER_TEST_DEVICE=cuda) at the 27B model's sizes."""

import pytest
import torch

from .conftest import compile_ahead, gpu_only, interpret, rel_error

# (tokens, key heads, value heads, key dim, value dim)
SMALL = [(1, 2, 2, 16, 16), (3, 1, 3, 32, 48), (8, 2, 4, 16, 64)]
REAL = [(1, 16, 48, 128, 128), (8, 16, 48, 128, 128)]


def worst_error(device: str, cases, dtype: torch.dtype = torch.float32) -> float:
    """Largest relative error against the reference, from random raw projections (the conv output and b/a in the
    model's dtype): outputs and final state of a step; a verify step's outputs with the state left as it was; and
    the replay of its first tokens into two layers' states at once (one of them a copy of the step's state); the
    raw b and a a verify step keeps."""
    from engine.kernels.gdn import gdn_replay_, gdn_step_
    from engine.models.gdn import GDNHeads, gated_delta_recurrent, gdn_inputs

    g = torch.Generator(device=device).manual_seed(4)
    worst = 0.0

    def rand(*shape):
        return torch.randn(*shape, generator=g, device=device)

    for t, hk, hv, dk, dv in cases:
        heads = GDNHeads(hk, dk, hv, dv)
        mixed = rand(t, 2 * hk * dk + hv * dv).to(dtype)
        # b and a as the model passes them: column slices of one projection (strided rows)
        proj = (rand(t, 2 * hv + 5) * torch.tensor([1.0] * (hv + 3) + [3.0] * (hv + 2), device=device)).to(dtype)
        b_raw, a_raw = proj[:, 3:3 + hv], proj[:, 3 + hv:3 + 2 * hv]
        neg_a, dt_bias = -rand(hv).exp(), rand(hv)
        state = rand(hv, dk, dv)
        inputs = gdn_inputs(mixed, b_raw, a_raw, neg_a, dt_bias, heads, torch.float32)
        want_o, want_s = gated_delta_recurrent(*inputs, state)
        # (verify: state left, value columns per program, warps, inputs first): launch shapes and both orders
        for frozen, *shape in ((False, 16, 1, True), (True, 16, 1, False), (False, 32, 4, False), (True, 32, 2, True)):
            s = state.clone()
            kept = torch.full((2, t, hv), 7.0, device=device, dtype=dtype) if frozen else None
            o = gdn_step_(mixed, b_raw, a_raw, neg_a, dt_bias, heads, s, frozen, *shape, keep_gates=kept)
            worst = max(worst, rel_error(o, want_o), rel_error(s, state if frozen else want_s))
            if frozen:  # a verify step keeps raw b and a for its commit, as they were
                worst = max(worst, float(not torch.equal(kept, torch.stack([b_raw, a_raw]))))
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


def gate_errors(device: str, cases, dtype: torch.dtype) -> tuple[float, float, float]:
    """The step kernel applying the GDN output gate as it writes the read-out (plain rows, and int8 rows in both
    orders where the value heads are whole groups of 64), decode and verify steps, launch after launch (the last
    program of each head to arrive applies it, and resets the count the next launch starts from): (relative
    error of the gated rows against `gdn_inputs` + `gated_delta_recurrent` + the torch gate, largest int8 code
    and scale differences against the quantizer on the gated rows)."""
    import torch.nn.functional as F

    from engine.kernels.actquant import empty_rows, quantize_rows
    from engine.kernels.gdn import OutputGate, gdn_step_
    from engine.models.gdn import GDNHeads, gated_delta_recurrent, gdn_inputs
    from engine.models.layers import rms_norm_reference

    g = torch.Generator(device=device).manual_seed(6)

    def rand(*shape):
        return torch.randn(*shape, generator=g, device=device)

    err, code, scale = 0.0, 0.0, 0.0
    for t, hk, hv, dk, dv in cases:
        heads = GDNHeads(hk, dk, hv, dv)
        mixed, (b_raw, a_raw) = rand(t, 2 * hk * dk + hv * dv).to(dtype), rand(2, t, hv).to(dtype)
        neg_a, dt_bias, state = -rand(hv).exp(), rand(hv), rand(hv, dk, dv)
        # z as the model passes it: a column slice of the input projection's rows
        z = rand(t, hv * dv + 3).to(dtype)[:, 3:].reshape(t, hv, dv)
        weight, eps = rand(dv).to(dtype), 1e-6
        o = gated_delta_recurrent(*gdn_inputs(mixed, b_raw, a_raw, neg_a, dt_bias, heads, torch.float32), state)[0]
        want = (rms_norm_reference(o.to(dtype), weight, eps) * F.silu(z.float())).to(dtype).reshape(t, -1)
        for split in (None, False, True) if dv % 64 == 0 else (None,):
            for frozen in (False, True):
                out = empty_rows((t, hv * dv), dtype, device) if split is not None else \
                    torch.empty(t, hv * dv, dtype=dtype, device=device)
                gdn_step_(mixed, b_raw, a_raw, neg_a, dt_bias, heads, state.clone(), frozen,
                          gate=OutputGate(z, weight, eps, out, bool(split)))
                rows = out.x if split is not None else out
                err = max(err, rel_error(rows, want))
                if split is not None:
                    codes, scales, _ = quantize_rows(rows.contiguous(), split)
                    code = max(code, (codes.int() - out.codes.int()).abs().max().item())
                    scale = max(scale, (scales - out.scales).abs().max().item())
    return err, code, scale


def test_output_gate_in_the_step_kernel_in_the_interpreter():
    code = ("import torch; from tests.test_gdn_kernel import gate_errors; "
            "e = gate_errors('cpu', [(1, 2, 2, 16, 16), (3, 1, 3, 32, 48), (2, 1, 2, 16, 64)], torch.float32); "
            "print(e[0] if e[1:] == (0, 0.0) else 1.0)")
    assert interpret(code) < 1e-5  # fp32 rows: the interpreter's bf16 casts do not round as a GPU's do


@gpu_only
def test_output_gate_in_the_step_kernel_on_the_gpu():
    err, code, scale = gate_errors("cuda", REAL, torch.bfloat16)
    # a code may sit one step apart on a .5 tie (see test_norm_kernel's int8 rows test)
    assert err < 1e-2 and code <= 1 and scale == 0.0


def test_kernel_matches_reference_in_the_interpreter():
    code = "from tests.test_gdn_kernel import SMALL, worst_error; print(worst_error('cpu', SMALL))"
    assert interpret(code) < 1e-5


@gpu_only
def test_kernel_matches_reference_on_the_gpu():
    assert worst_error("cuda", REAL, torch.bfloat16) < 1e-4


@gpu_only
def test_fla_prefill_matches_the_chunked_reference():
    """fla-core from the raw projections (norms, gates and beta inside its kernels; 16 key heads shared by 48
    value heads) against `gdn_inputs` + `gated_delta_chunked` in fp32 on the same bf16 inputs, the 27B's heads,
    a chunk that is not a multiple of fla's 64."""
    pytest.importorskip("fla.ops.gated_delta_rule")
    from engine.kernels.gdn import fla_chunked_
    from engine.models.gdn import GDNHeads, gated_delta_chunked, gdn_inputs

    g = torch.Generator(device="cuda").manual_seed(5)
    heads, t = GDNHeads(16, 128, 48, 128), 1000
    mixed = torch.randn(t, 2 * 16 * 128 + 48 * 128, generator=g, device="cuda").bfloat16()
    b_raw, a_raw = torch.randn(2, t, 48, generator=g, device="cuda").bfloat16()
    a_log = torch.rand(48, generator=g, device="cuda") * 2 - 1
    dt_bias = torch.randn(48, generator=g, device="cuda")
    state = torch.randn(48, 128, 128, generator=g, device="cuda") * 0.1
    inputs = gdn_inputs(mixed.float(), b_raw.float(), a_raw.float(), -a_log.exp(), dt_bias, heads, torch.float32)
    want_o, want_s = gated_delta_chunked(*inputs, state.clone())
    s = state.clone()
    o = fla_chunked_(mixed, b_raw, a_raw, a_log, dt_bias, heads, s)
    assert o.shape == want_o.shape
    assert rel_error(o, want_o) < 1e-2
    assert rel_error(s, want_s) < 1e-2


def test_step_kernel_compiles_for_the_users_gpus():
    from engine.kernels import gdn

    sig = {p: "*bf16" for p in ("mix_ptr", "b_ptr", "a_ptr", "z_ptr", "nw_ptr", "out_ptr")}
    sig.update({p: "*fp32" for p in ("na_ptr", "dt_ptr", "s_ptr", "o_ptr", "qs_ptr")}, kept_ptr="*bf16")
    sig.update(q_ptr="*i8", qsum_ptr="*i32", cnt_ptr="*i32", z_tok="i32", eps="fp32")
    sig.update({a: "i32" for a in ("T", "HV", "REP", "DK", "DV", "C", "mix_layer", "gate_layer", "gate_row")})
    for keep in (True, False):  # a verify step with the output gate, a decode step without
        consts = dict(STORE_STATE=not keep, STORE_OUT=True, BLOCK_K=128, BLOCK_V=16, T_P2=8, INPUTS_FIRST=False,
                      KEEP_GATES=keep, NORM=keep, QUANT=keep, SPLIT=keep, BLOCK_DV=128)
        for ptx in compile_ahead(gdn._build(), sig, consts, warps=1, pdl=True):
            assert ".entry gdn_step_kernel" in ptx
