"""Gated DeltaNet recurrent update for decode/verify steps (T <= 8 tokens), fused from the raw projections:
each program keeps one [Dk, BLOCK_V] tile of a value head's fp32 state in registers for all T tokens and does
the L2 norms of q and k, beta = sigmoid(b), the decay from a, the delta-rule correction, the write and the
read-out in place, so the state is read and written once per step and ~20 torch ops become one launch. A verify
step leaves the state as it found it (its tokens may be rejected); `gdn_replay_` then moves every layer's state on
by the tokens that were kept, from their saved inputs, in one launch.

The reference is `engine.models.gdn.gdn_inputs` + `gated_delta_recurrent`; `usable` says when the kernel serves. Prefill
chunks take fla-core's `chunk_gated_delta_rule` when that optional package is installed (`pip install
ninfer[gpu]`), checked against `gated_delta_chunked`.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from . import runs_here
from .actquant import QuantRows

_kernel = None


def usable(state: torch.Tensor) -> bool:
    if state.dtype != torch.float32:
        return False  # fp64 oracle runs take the reference
    return runs_here(state)


def _build():
    import triton.language as tl
    from triton import jit

    # a jit kernel finds the jit functions it calls among its globals
    global enter, token_inputs, unit_norm, beta_decay, gated_output, quantize_groups, silu_gated, weighted
    from .pdl import enter
    from .rownorm import silu_gated, weighted
    from .rowquant import quantize_groups

    @jit
    def token_inputs(mix_ptr, b_ptr, a_ptr, t, h, kh, key_dim, rk, rv, k_ok, v_ok, gate_row, DK, DV, C):
        """Token t's q, k (key head kh) and v columns, raw b and a (value head h; rows gate_row apart), as fp32."""
        row = mix_ptr + t * C
        q = tl.load(row + kh * DK + rk, mask=k_ok, other=0.0).to(tl.float32)
        k = tl.load(row + key_dim + kh * DK + rk, mask=k_ok, other=0.0).to(tl.float32)
        v = tl.load(row + 2 * key_dim + h * DV + rv, mask=v_ok, other=0.0).to(tl.float32)
        b, a = tl.load(b_ptr + t * gate_row + h).to(tl.float32), tl.load(a_ptr + t * gate_row + h).to(tl.float32)
        return q, k, v, b, a

    @jit
    def unit_norm(x, AXIS: tl.constexpr, scale):
        """x's rows (AXIS 1 of [tokens, Dk]) or x itself (AXIS 0 of [Dk]) L2-normed as the reference, times scale."""
        return x * tl.rsqrt(tl.sum(x * x, AXIS, keep_dims=True) + 1e-6) * scale

    @jit
    def beta_decay(b, a, neg_a, dt_bias):
        """beta = sigmoid(b) and the state's decay exp(-A * softplus(a + dt_bias)), softplus as torch's."""
        a = a + dt_bias
        return tl.sigmoid(b), tl.exp(neg_a * tl.where(a > 20.0, a, tl.log(1.0 + tl.exp(a))))

    @jit
    def gated_output(o_ptr, z_ptr, w_ptr, out_ptr, q_ptr, qs_ptr, qsum_ptr, h, T, HV, DV, z_tok, eps,
                     QUANT: tl.constexpr, SPLIT: tl.constexpr, BLOCK_DV: tl.constexpr):
        """Value head h's read-outs of all T tokens (fp32, in o) through the GDN output gate: plain-order RMSNorm
        of the read-out cast to the model dtype, times silu(z), into out [T, HV * DV] (and its int8 rows)."""
        COLS: tl.constexpr = 64 if BLOCK_DV >= 64 else BLOCK_DV  # int8 groups of 64 as the tile's rows
        tile = tl.arange(0, BLOCK_DV // COLS)[:, None] * COLS + tl.arange(0, COLS)[None, :]
        ok = tile < DV
        dt = out_ptr.dtype.element_ty
        w = tl.load(w_ptr + tile, mask=ok, other=0.0).to(tl.float32)
        for t in range(T):
            # .cg: the other programs' read-outs come from L2, never from a line this SM's L1 kept
            x = tl.load(o_ptr + (t * HV + h) * DV + tile, mask=ok, other=0.0, cache_modifier=".cg")
            x = x.to(dt).to(tl.float32)
            rstd = tl.rsqrt(tl.sum(tl.sum(x * x, 1), 0) / DV + eps)
            z = tl.load(z_ptr + t * z_tok + h * DV + tile, mask=ok, other=0.0).to(tl.float32)
            out = silu_gated(weighted(x, rstd, w, dt, False), z).to(dt)
            tl.store(out_ptr + (t * HV + h) * DV + tile, out, mask=ok)
            if QUANT:
                g = tl.arange(0, BLOCK_DV // COLS)
                quantize_groups(out.to(tl.float32), h * (DV // 64), g < DV // 64, t, HV * DV, q_ptr, qs_ptr,
                                qsum_ptr, SPLIT, BLOCK_DV // COLS)

    @jit
    def gdn_step_kernel(mix_ptr, b_ptr, a_ptr, na_ptr, dt_ptr, s_ptr, o_ptr, kept_ptr, T, HV, REP, DK, DV, C,
                        mix_layer, gate_layer, gate_row, z_ptr, nw_ptr, out_ptr, q_ptr, qs_ptr, qsum_ptr, cnt_ptr,
                        z_tok, eps, STORE_STATE: tl.constexpr, STORE_OUT: tl.constexpr,
                        BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr, T_P2: tl.constexpr, INPUTS_FIRST: tl.constexpr,
                        KEEP_GATES: tl.constexpr, NORM: tl.constexpr, QUANT: tl.constexpr, SPLIT: tl.constexpr,
                        BLOCK_DV: tl.constexpr, PDL: tl.constexpr):
        enter(PDL)
        h, pv, layer = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        mix_ptr += layer * mix_layer  # program axis 2: the layers of a replay (one layer otherwise)
        b_ptr += layer * gate_layer
        a_ptr += layer * gate_layer
        na_ptr += layer * HV
        dt_ptr += layer * HV
        s_ptr += layer * HV * DK * DV
        kh = h // REP  # the key head this value head reads
        key_dim = (HV // REP) * DK
        rk = tl.arange(0, BLOCK_K)
        rv = pv * BLOCK_V + tl.arange(0, BLOCK_V)
        k_ok, v_ok = rk < DK, rv < DV
        tile = rk[:, None] * DV + rv[None, :]
        tile_ok = k_ok[:, None] & v_ok[None, :]
        s = tl.load(s_ptr + h * DK * DV + tile, mask=tile_ok, other=0.0)
        neg_a, dt_bias = tl.load(na_ptr + h), tl.load(dt_ptr + h)
        if KEEP_GATES:  # a verify step keeps raw b, a [2, T, HV] for its commit: written by each head's first program
            if pv == 0:
                rt = tl.arange(0, T_P2)
                t_ok = rt < T
                tl.store(kept_ptr + rt * HV + h, tl.load(b_ptr + rt * gate_row + h, mask=t_ok), mask=t_ok)
                tl.store(kept_ptr + (T + rt) * HV + h, tl.load(a_ptr + rt * gate_row + h, mask=t_ok), mask=t_ok)
        if INPUTS_FIRST:
            # every token's inputs first, normed and gated together; token t's row is then picked out of the
            # tiles by a masked sum (over one nonzero: exact)
            rt = tl.arange(0, T_P2)
            t_ok = rt < T
            rows = mix_ptr + rt[:, None] * C
            q = tl.load(rows + kh * DK + rk[None, :], mask=t_ok[:, None] & k_ok[None, :], other=0.0).to(tl.float32)
            k = tl.load(rows + key_dim + kh * DK + rk[None, :], mask=t_ok[:, None] & k_ok[None, :],
                        other=0.0).to(tl.float32)
            v = tl.load(rows + 2 * key_dim + h * DV + rv[None, :], mask=t_ok[:, None] & v_ok[None, :],
                        other=0.0).to(tl.float32)
            q, k = unit_norm(q, 1, tl.rsqrt(DK * 1.0)), unit_norm(k, 1, 1.0)
            beta, decay = beta_decay(tl.load(b_ptr + rt * gate_row + h, mask=t_ok, other=0.0).to(tl.float32),
                                     tl.load(a_ptr + rt * gate_row + h, mask=t_ok, other=0.0).to(tl.float32), neg_a,
                                     dt_bias)
        else:  # token by token, the next token's loads issued before this token's update
            qn, kn, vn, bn, an = token_inputs(mix_ptr, b_ptr, a_ptr, 0, h, kh, key_dim, rk, rv, k_ok, v_ok, gate_row,
                                              DK, DV, C)
        for t in range(T):
            if INPUTS_FIRST:
                pick = rt == t
                qt = tl.sum(tl.where(pick[:, None], q, 0.0), 0)
                kt = tl.sum(tl.where(pick[:, None], k, 0.0), 0)
                vt = tl.sum(tl.where(pick[:, None], v, 0.0), 0)
                decay_t = tl.sum(tl.where(pick, decay, 0.0), 0)
                beta_t = tl.sum(tl.where(pick, beta, 0.0), 0)
            else:
                qt, kt, vt, bt, at = qn, kn, vn, bn, an
                qn, kn, vn, bn, an = token_inputs(mix_ptr, b_ptr, a_ptr, tl.minimum(t + 1, T - 1), h, kh, key_dim,
                                                  rk, rv, k_ok, v_ok, gate_row, DK, DV, C)
                qt, kt = unit_norm(qt, 0, tl.rsqrt(DK * 1.0)), unit_norm(kt, 0, 1.0)
                beta_t, decay_t = beta_decay(bt, at, neg_a, dt_bias)
            s = s * decay_t
            u = beta_t * (vt - tl.sum(kt[:, None] * s, 0))
            s = s + kt[:, None] * u[None, :]
            if STORE_OUT:
                tl.store(o_ptr + (t * HV + h) * DV + rv, tl.sum(qt[:, None] * s, 0), mask=v_ok)
        if STORE_STATE:
            tl.store(s_ptr + h * DK * DV + tile, s, mask=tile_ok)
        if NORM:
            # the output gate needs a head's whole read-out, which its BLOCK_V-wide programs write in parts: the
            # last of them to arrive (counted per head; the barrier puts every warp's stores before the count)
            # applies it, then zeroes the count for the next launch
            tl.debug_barrier()
            if tl.atomic_add(cnt_ptr + h, 1, sem="acq_rel") == tl.num_programs(1) - 1:
                gated_output(o_ptr, z_ptr, nw_ptr, out_ptr, q_ptr, qs_ptr, qsum_ptr, h, T, HV, DV, z_tok, eps, QUANT,
                             SPLIT, BLOCK_DV)
                tl.store(cnt_ptr + h, 0)

    return gdn_step_kernel


@dataclass
class OutputGate:
    """Qwen3.5's GDN output gate, for the step kernel to apply on its way out: the plain-order RMSNorm of each value
    head's read-out (cast to the model dtype) by `weight`, times silu(z) (z [T, Hv, Dv], any strides but the
    last two), written into `out` [T, Hv * Dv]: model-dtype rows, or QuantRows whose int8 rows are split into
    even/odd planes when `split` (the out projection's input: `engine.models.layers.gated_rms_norm`'s contract)."""

    z: torch.Tensor
    weight: torch.Tensor
    eps: float
    out: torch.Tensor | QuantRows
    split: bool = False


_arrivals: dict[torch.device, torch.Tensor] = {}


def _arrival_counts(device: torch.device, heads: int) -> torch.Tensor:
    """Per value head, how many of its programs have written their read-out (zero between launches: the last
    program resets its head's count). One buffer per device serves every layer, since steps run one at a time."""
    counts = _arrivals.get(device)
    if counts is None or counts.numel() < heads:
        counts = _arrivals[device] = torch.zeros(max(heads, 64), dtype=torch.int32, device=device)
    return counts


def gdn_step_(mixed, b_raw, a_raw, neg_a, dt_bias, heads, state, frozen: bool = False, block_v: int = 16,
              warps: int = 1, inputs_first: bool | None = None, keep_gates: torch.Tensor | None = None,
              gate: OutputGate | None = None) -> torch.Tensor:
    """Contract of `engine.models.gdn.recurrent_update_`: mixed [T, 2*Hk*Dk + Hv*Dv] (the conv output), b_raw and
    a_raw [T, Hv], neg_a and dt_bias [Hv] fp32, state [Hv, Dk, Dv] fp32 updated in place unless `frozen`.
    `block_v` (value columns of the state per program) and `warps`: the launch shape; `inputs_first`: every
    token's inputs loaded before the sequential update, or each token's one token ahead inside it (default: first
    for one token, ahead for more). The defaults won `scripts/bench_step_kernels.py --only mixer`: one warp of
    16 columns keeps the reductions over Dk inside a warp (far faster than 32 columns over 4 warps), and at T = 8
    loading each token's row one token ahead beat picking it out of the tiles by masked sums, while at T = 1
    loading the inputs first won. b_raw and a_raw may be column slices of one projection (rows the same stride
    apart: no copies); `keep_gates` [2, T, Hv] receives them for a verify step's commit. With `gate`, the read-out
    goes through it into `gate.out` in the same launch (the returned read-out is then the kernel's scratch)."""
    t = mixed.shape[0]
    assert keep_gates is None or (keep_gates.is_contiguous() and keep_gates.shape == (2, t, heads.value_heads))
    if b_raw.stride(-1) != 1 or a_raw.stride(-1) != 1 or b_raw.stride(0) != a_raw.stride(0):
        b_raw, a_raw = b_raw.contiguous(), a_raw.contiguous()
    o = torch.empty(t, heads.value_heads, heads.value_dim, dtype=state.dtype, device=state.device)
    _launch(mixed.contiguous(), b_raw, a_raw, neg_a, dt_bias, heads, state, o, t, 1, 0, 0, not frozen, block_v,
            warps, inputs_first, gate_row=b_raw.stride(0), keep_gates=keep_gates, gate=gate)
    return o


def gdn_replay_(inputs, gates, neg_a, dt_bias, heads, state, keep: int, block_v: int = 16, warps: int = 1) -> None:
    """Every layer's state [layers, Hv, Dk, Dv] moved on by the first `keep` tokens of a verify step, from the
    inputs it saved: inputs [layers, T, C] (conv output rows), gates [layers, 2, T, Hv] (raw b, raw a), neg_a and
    dt_bias [layers, Hv]; one launch, no outputs."""
    assert inputs.is_contiguous() and gates.is_contiguous() and state.is_contiguous()
    _launch(inputs, gates[:, 0], gates[:, 1], neg_a.contiguous(), dt_bias.contiguous(), heads, state, state, keep,
            state.shape[0], inputs.stride(0), gates.stride(0), True, block_v, warps, None, store_out=False,
            gate_row=gates.stride(2))


def _launch(mixed, b, a, neg_a, dt_bias, heads, state, o, t: int, layers: int, mix_layer: int, gate_layer: int,
            store_state: bool, block_v: int, warps: int, inputs_first: bool | None, store_out: bool = True,
            gate_row: int = 0, keep_gates: torch.Tensor | None = None, gate: OutputGate | None = None) -> None:
    import triton

    from . import pdl

    global _kernel
    if _kernel is None:
        _kernel = _build()
    hv, dk, dv = heads.value_heads, heads.key_dim, heads.value_dim
    block_v = min(block_v, triton.next_power_of_2(dv))
    if gate is not None:
        assert layers == 1 and store_out and gate.z.stride(-1) == 1 and gate.z.stride(-2) == dv
        rows = gate.out if isinstance(gate.out, QuantRows) else QuantRows(gate.out, o, o, o)
        z, weight, eps, quant = gate.z, gate.weight, gate.eps, isinstance(gate.out, QuantRows)
        counts = _arrival_counts(o.device, hv)
    else:  # unused pointers
        rows, z, weight, eps, quant, counts = QuantRows(o, o, o, o), o, o, 0.0, False, o
    _kernel[(hv, triton.cdiv(dv, block_v), layers)](
        mixed, b, a, neg_a, dt_bias, state, o, keep_gates if keep_gates is not None else b, t, hv,
        hv // heads.key_heads, dk, dv, mixed.stride(-2), mix_layer, gate_layer, gate_row, z, weight, rows.x,
        rows.codes, rows.scales, rows.sums, counts, z.stride(0), eps, STORE_STATE=store_state,
        STORE_OUT=store_out, BLOCK_K=triton.next_power_of_2(dk), BLOCK_V=block_v, T_P2=triton.next_power_of_2(t),
        INPUTS_FIRST=t == 1 if inputs_first is None else inputs_first, KEEP_GATES=keep_gates is not None,
        NORM=gate is not None, QUANT=quant, SPLIT=bool(gate is not None and gate.split),
        BLOCK_DV=triton.next_power_of_2(dv), num_warps=warps, **pdl.launch(o))


def fla_usable(mixed: torch.Tensor) -> bool:
    """fla-core for half-precision prefill on a GPU. fp32 and fp64 runs are the exact (oracle) paths and take the
    reference: fla-core 0.6.0 rounds fp32 inputs through TF32 in all but one of its dots."""
    return mixed.device.type == "cuda" and mixed.dtype in (torch.bfloat16, torch.float16) and _fla_installed()


@functools.cache
def _fla_installed() -> bool:
    """Probed once: a failed import searches the whole path again each time, and prefill asks per layer."""
    try:
        import fla.ops.gated_delta_rule  # noqa: F401
    except ImportError:
        return False
    return True


def fla_chunked_(mixed, b_raw, a_raw, a_log, dt_bias, heads, state) -> torch.Tensor:
    """A prefill chunk through fla-core from the raw projections, as transformers' Qwen3.5 calls it: the q/k L2
    norms, beta = sigmoid(b) and g = -exp(A_log) * softplus(a + dt_bias) computed inside its kernels, value head
    j reading key head j // (Hv/Hk) (its GVA) with no repeated copies, q and k in the model's dtype. Returns
    o [T, Hv, Dv] in mixed's dtype; `state` [Hv, Dk, Dv] (fp32) is moved on in place."""
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    t, hk, dk, hv, dv = mixed.shape[0], heads.key_heads, heads.key_dim, heads.value_heads, heads.value_dim
    q, k, v = mixed.split([hk * dk, hk * dk, hv * dv], dim=-1)
    o, final = chunk_gated_delta_rule(
        q.reshape(1, t, hk, dk), k.reshape(1, t, hk, dk), v.reshape(1, t, hv, dv), a_raw[None], b_raw[None],
        scale=dk ** -0.5, initial_state=state[None], output_final_state=True, use_qk_l2norm_in_kernel=True,
        use_gate_in_kernel=True, A_log=a_log, dt_bias=dt_bias, use_beta_sigmoid_in_kernel=True)
    state.copy_(final[0])
    return o[0]
