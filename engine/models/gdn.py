"""Gated DeltaNet (Qwen3.5 linear attention) in plain torch: causal conv1d with its state, and the gated delta
rule in two equivalent forms (token-by-token recurrence, and the chunked WY form for prefill).

Per value head, with state S in R^{Dk x Dv} (fp32):
    S <- exp(g_t) S;  u_t = beta_t (v_t - S^T k_t);  S <- S + k_t u_t^T;  o_t = S^T q_t
q and k arrive L2-normalised, q already scaled by 1/sqrt(Dk), and k/q heads repeated to the value heads.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


def causal_conv1d(x: torch.Tensor, conv_state: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Depthwise causal conv + SiLU. x: [T, C]; conv_state: [K-1, C] (the previous K-1 inputs); weight: [C, K].
    Returns (out [T, C], window [K-1+T, C]): the conv state after step j is window[j+1 : j+K], so the
    state after all T steps is the window's last K-1 rows and a verify step can roll back to any step."""
    window = torch.cat([conv_state.to(x.dtype), x], dim=0)  # [K-1+T, C]
    out = F.conv1d(window.t()[None], weight[:, None, :].to(x.dtype), groups=weight.shape[0])[0].t()
    return F.silu(out), window


def conv_step_(x: torch.Tensor, conv_state: torch.Tensor, weight: torch.Tensor,
               window: torch.Tensor | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """`causal_conv1d` with `conv_state` moved on in place, the window written into `window` and the output into
    `out` when given (a verify step keeps both); returns the output. On a GPU one fused kernel
    (`engine/kernels/conv.py`), prefill chunks too."""
    from ..kernels import conv

    if conv.usable(x, conv_state):
        return conv.conv_update_(x, conv_state, weight, window, out=out)
    result, full = causal_conv1d(x, conv_state, weight)
    conv_state.copy_(full[x.shape[0]:])
    if window is not None:
        window.copy_(full)
    return result if out is None else out.copy_(result)


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def gated_delta_recurrent(q, k, v, g, beta, state):
    """q, k: [T, H, Dk]; v: [T, H, Dv]; g, beta: [T, H]; state: [H, Dk, Dv], all in the
    accumulation dtype (fp32; fp64 in oracle runs).
    Returns (o [T, H, Dv], final state)."""
    out = torch.empty_like(v)
    s = state
    for t in range(q.shape[0]):
        s = s * g[t].exp()[:, None, None]
        pred = torch.einsum("hk,hkv->hv", k[t], s)
        u = beta[t][:, None] * (v[t] - pred)
        s = s + k[t][:, :, None] * u[:, None, :]
        out[t] = torch.einsum("hk,hkv->hv", q[t], s)
    return out, s


@dataclass(frozen=True)
class GDNHeads:
    key_heads: int
    key_dim: int
    value_heads: int
    value_dim: int


def gdn_inputs(mixed, b_raw, a_raw, neg_a, dt_bias, heads: GDNHeads, acc: torch.dtype):
    """From the conv output [T, 2*Hk*Dk + Hv*Dv] and the b/a projections [T, Hv] to the rule's q, k, v, g, beta
    in `acc`: q and k L2-normalised (q also scaled by Dk^-1/2) and repeated to the value heads (value head j reads
    key head j // (Hv/Hk)), beta = sigmoid(b), g = -exp(A_log) * softplus(a + dt_bias)."""
    t, hk, dk, hv, dv = mixed.shape[0], heads.key_heads, heads.key_dim, heads.value_heads, heads.value_dim
    q, k, v = mixed.split([hk * dk, hk * dk, hv * dv], dim=-1)
    rep = hv // hk
    q = (l2norm(q.to(acc).view(t, hk, dk)) * dk ** -0.5).repeat_interleave(rep, dim=1)
    k = l2norm(k.to(acc).view(t, hk, dk)).repeat_interleave(rep, dim=1)
    return q, k, v.to(acc).view(t, hv, dv), neg_a * F.softplus(a_raw.to(acc) + dt_bias), torch.sigmoid(b_raw.to(acc))


def output_gate(z: torch.Tensor, weight: torch.Tensor, eps: float, dtype: torch.dtype, state: torch.Tensor,
                feeds=None):
    """The GDN output gate (`gated_rms_norm` of the read-out by `weight`, times silu(z [T, Hv, Dv]), into
    `dtype`) for the step kernel to apply as it writes the read-out, with rows allocated for it (and the int8 rows
    of `feeds`, the out projection, where that matmul reads them): an `OutputGate`, or None where the kernel does
    not serve `state` and the caller norms the read-out itself."""
    from ..kernels import gdn as kernel
    from ..kernels import norm
    from ..kernels.actquant import empty_rows
    from .layers import int8_split

    if not (kernel.usable(state) and norm.usable(z, weight, dtype)):
        return None
    t, hv, dv = z.shape
    split = int8_split((t, hv * dv), dtype, z.device, feeds) if dv % 64 == 0 else None
    out = empty_rows((t, hv * dv), dtype, z.device) if split is not None else \
        torch.empty(t, hv * dv, dtype=dtype, device=z.device)
    return kernel.OutputGate(z, weight, eps, out, bool(split))


def recurrent_update_(mixed, b_raw, a_raw, neg_a, dt_bias, heads: GDNHeads, state, frozen: bool = False,
                      keep_gates: torch.Tensor | None = None, gate=None) -> torch.Tensor:
    """A decode/verify step (T <= 8) of the rule from the raw projections, `state` updated in place (a slot of
    the cache) unless `frozen` (a verify step, whose kept tokens `replay_` applies later): one fused kernel where
    it serves, else `gdn_inputs` + `gated_delta_recurrent`. Returns o [T, Hv, Dv] in the state's dtype.
    `keep_gates` [2, T, Hv] receives b_raw and a_raw (what a verify step keeps for `replay_`). `gate` (from
    `output_gate`, which gives one only where the kernel serves) is applied by the kernel into `gate.out`."""
    from ..kernels import gdn as kernel

    if kernel.usable(state):
        return kernel.gdn_step_(mixed, b_raw, a_raw, neg_a, dt_bias, heads, state, frozen, keep_gates=keep_gates,
                                gate=gate)
    assert gate is None, "the output gate is fused only where the step kernel serves"
    if keep_gates is not None:
        keep_gates[0].copy_(b_raw)
        keep_gates[1].copy_(a_raw)
    q, k, v, g, beta = gdn_inputs(mixed, b_raw, a_raw, neg_a, dt_bias, heads, state.dtype)
    out, final = gated_delta_recurrent(q, k, v, g, beta, state)
    if not frozen:
        state.copy_(final)
    return out


def replay_(kept, state: torch.Tensor, keep: int, neg_a: torch.Tensor, dt_bias: torch.Tensor,
            heads: GDNHeads) -> None:
    """Every GDN layer's recurrent state [layers, Hv, Dk, Dv] moved on by the first `keep` tokens of the verify
    step that saved their inputs in `kept` (a KeptInputs); neg_a and dt_bias [layers, Hv]. One kernel launch
    over all layers where it serves."""
    from ..kernels import gdn as kernel

    if kernel.usable(state):
        kernel.gdn_replay_(kept.inputs, kept.gates, neg_a, dt_bias, heads, state, keep)
        return
    for layer in range(state.shape[0]):
        gates = kept.gates[layer, :, :keep]
        recurrent_update_(kept.inputs[layer, :keep], gates[0], gates[1], neg_a[layer], dt_bias[layer], heads,
                          state[layer])


def chunked_update_(mixed, b_raw, a_raw, a_log, dt_bias, heads: GDNHeads, state) -> torch.Tensor:
    """A prefill chunk of the rule from the raw projections, `state` updated in place: fla-core's kernels where
    they serve (o in mixed's dtype), else `gdn_inputs` + `gated_delta_chunked` (o in the state's)."""
    from ..kernels import gdn as kernel

    if kernel.fla_usable(mixed):
        return kernel.fla_chunked_(mixed, b_raw, a_raw, a_log, dt_bias, heads, state)
    out, final = gated_delta_chunked(*gdn_inputs(mixed, b_raw, a_raw, -a_log.exp(), dt_bias, heads, state.dtype),
                                     state)
    state.copy_(final)
    return out


def gated_delta_chunked(q, k, v, g, beta, state, chunk: int = 64):
    """Same contract as `gated_delta_recurrent`, computed chunk by chunk: within a
    chunk the delta-rule updates are folded into one unit-lower-triangular solve (the WY/UT form)."""
    t_len, heads, dk = k.shape
    dv = v.shape[-1]
    pad = (-t_len) % chunk
    if pad:
        q, k, v = (F.pad(x, (0, 0, 0, 0, 0, pad)) for x in (q, k, v))
        g, beta = (F.pad(x, (0, 0, 0, pad)) for x in (g, beta))
    n = q.shape[0] // chunk
    # [H, N, C, D] layout: heads and chunks as batch dims
    q, k, v = (x.reshape(n, chunk, heads, -1).permute(2, 0, 1, 3) for x in (q, k, v))
    g, beta = (x.reshape(n, chunk, heads).permute(2, 0, 1) for x in (g, beta))
    gam = g.cumsum(-1)  # log decay from the chunk start to each position
    decay = (gam[..., :, None] - gam[..., None, :]).masked_fill(
        torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).triu(1), float("-inf")).exp()  # i >= j
    kb, vb = k * beta[..., None], v * beta[..., None]
    system = (kb @ k.transpose(-1, -2)) * decay  # strictly-lower part enters the solve; unit diagonal implied
    solve = torch.linalg.solve_triangular
    u0 = solve(system, vb, upper=False, unitriangular=True)  # values corrected for in-chunk writes
    w = solve(system, kb * gam.exp()[..., None], upper=False, unitriangular=True)  # their reads of the old state
    attn = (q @ k.transpose(-1, -2)) * decay
    q_decayed = q * gam.exp()[..., None]
    k_to_end = k * (gam[..., -1:] - gam).exp()[..., None]
    out = torch.empty(heads, n, chunk, dv, dtype=v.dtype, device=q.device)
    s = state
    for i in range(n):
        u = u0[:, i] - w[:, i] @ s
        out[:, i] = q_decayed[:, i] @ s + attn[:, i] @ u
        s = s * gam[:, i, -1].exp()[:, None, None] + k_to_end[:, i].transpose(-1, -2) @ u
    out = out.reshape(heads, n * chunk, dv).transpose(0, 1)[:t_len]
    return out, s
