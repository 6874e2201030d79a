"""Gated DeltaNet recurrent update for decode/verify steps (T <= 8 tokens), fused: each program keeps one
[Dk, BLOCK_V] tile of a head's fp32 state in registers for all T tokens (decay, delta-rule correction, write,
read-out), so the state is read and written once per step instead of ~8 times per token by separate torch ops.
A verify step also stores the state after every token (the rollback points of speculative decoding).

The reference is `engine.models.gdn.gated_delta_recurrent`; `usable` says when the kernel serves. Prefill
chunks take fla-core's `chunk_gated_delta_rule` when that optional package is installed (`pip install
ninfer[gpu]`), checked against `gated_delta_chunked`.
"""
from __future__ import annotations

import os

import torch

_kernel = None


def usable(state: torch.Tensor) -> bool:
    if state.dtype != torch.float32:
        return False  # fp64 oracle runs take the reference
    if state.device.type == "cuda":
        return True
    return os.environ.get("TRITON_INTERPRET") == "1" and os.environ.get("NINFER_TRITON_ON_CPU") == "1"


def _build():
    import triton.language as tl
    from triton import jit

    @jit
    def kernel(q_ptr, k_ptr, v_ptr, g_ptr, b_ptr, s_ptr, o_ptr, steps_ptr, T, H, DK, DV,
               KEEP: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr):
        h, pv = tl.program_id(0), tl.program_id(1)
        rk = tl.arange(0, BLOCK_K)
        rv = pv * BLOCK_V + tl.arange(0, BLOCK_V)
        k_ok, v_ok = rk < DK, rv < DV
        tile = rk[:, None] * DV + rv[None, :]
        tile_ok = k_ok[:, None] & v_ok[None, :]
        s = tl.load(s_ptr + h * DK * DV + tile, mask=tile_ok, other=0.0)
        for t in range(T):
            row = t * H + h
            kt = tl.load(k_ptr + row * DK + rk, mask=k_ok, other=0.0)
            qt = tl.load(q_ptr + row * DK + rk, mask=k_ok, other=0.0)
            vt = tl.load(v_ptr + row * DV + rv, mask=v_ok, other=0.0)
            s = s * tl.exp(tl.load(g_ptr + row))
            u = tl.load(b_ptr + row) * (vt - tl.sum(kt[:, None] * s, 0))
            s = s + kt[:, None] * u[None, :]
            tl.store(o_ptr + row * DV + rv, tl.sum(qt[:, None] * s, 0), mask=v_ok)
            if KEEP:
                tl.store(steps_ptr + row * DK * DV + tile, s, mask=tile_ok)
        tl.store(s_ptr + h * DK * DV + tile, s, mask=tile_ok)

    return kernel


def fla_usable(state: torch.Tensor) -> bool:
    if state.device.type != "cuda" or state.dtype != torch.float32:
        return False
    try:
        import fla.ops.gated_delta_rule  # noqa: F401
    except ImportError:
        return False
    return True


def fla_chunked_(q, k, v, g, beta, state) -> torch.Tensor:
    """The chunked (prefill) form through fla-core: same contract as `gdn_recurrent_` without per-step states;
    q arrives scaled already, so fla's scale is 1."""
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    o, final = chunk_gated_delta_rule(q[None], k[None], v[None], g[None], beta[None], scale=1.0,
                                      initial_state=state[None], output_final_state=True)
    state.copy_(final[0])
    return o[0]


def gdn_recurrent_(q, k, v, g, beta, state, keep_states: bool = False):
    """q, k: [T, H, Dk]; v: [T, H, Dv]; g, beta: [T, H], fp32; state [H, Dk, Dv] fp32, updated in place.
    Returns (o [T, H, Dv], per-step states [T, H, Dk, Dv] or None)."""
    import triton

    global _kernel
    if _kernel is None:
        _kernel = _build()
    t, h, dk = k.shape
    dv = v.shape[-1]
    o = torch.empty(t, h, dv, dtype=state.dtype, device=state.device)
    steps = torch.empty(t, h, dk, dv, dtype=state.dtype, device=state.device) if keep_states else o
    block_v = min(32, triton.next_power_of_2(dv))
    _kernel[(h, triton.cdiv(dv, block_v))](q.contiguous(), k.contiguous(), v.contiguous(), g.contiguous(),
                                           beta.contiguous(), state, o, steps, t, h, dk, dv, KEEP=keep_states,
                                           BLOCK_K=triton.next_power_of_2(dk), BLOCK_V=block_v, num_warps=4)
    return o, (steps if keep_states else None)
