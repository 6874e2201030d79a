"""Decode/verify attention over the paged KV cache (T <= 8 query tokens per launch, 16 per call), split-KV
(flash-decoding) with in-kernel dequantization of int8/fp8 KV; each key's row is found through the sequence's
block table.

Where the queries stand is read from a device tensor (`positions`, one per query token, consecutive), never from
the host, so a captured CUDA graph replays it at any cache length: query t sees keys 0..positions[t]. A program
owns one KV head and one slice of the context; its rows are the (token, query head) pairs that read that KV head
(GQA), so each KV tile is loaded once for all of them. Slices write an fp32 partial output and its log-sum-exp;
a second small kernel weighs them (and applies gated attention's output gate). The reference is
`causal_attention` over the dequantized prefix.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..cache.kv_cache import KVCache
from . import runs_here
from .actquant import QuantRows, empty_rows

MAX_QUERY_TOKENS = 8  # per launch: T x the heads a KV head serves fill the tile of query rows
MAX_STEP_TOKENS = 16  # per call (a graphed prefill piece): launches of MAX_QUERY_TOKENS queries each


def usable(q: torch.Tensor) -> bool:
    """Whether the kernel serves these queries [T, H, D] here (a GPU, or the interpreter in kernel tests)."""
    if q.shape[0] > MAX_STEP_TOKENS or q.dtype == torch.float64:
        return False  # fp64 oracle runs take the reference: the kernel accumulates in fp32
    return runs_here(q)


@dataclass(frozen=True)
class Tile:
    """Launch shape: keys per loop iteration, warps (for heads wider than 128 dims; 4 below), programs per SM.
    The default won the launch-shape sweep for 8K int8 KV at T = 1 and 8 (`scripts/bench_step_kernels.py --only
    attention`): small key tiles keep more loads in flight per register budget."""

    block_n: int = 32
    warps: int = 4
    per_sm: int = 2


def splits_for(kv_heads: int, device: torch.device, per_sm: int) -> int:
    """Context slices per KV head: about `per_sm` programs per SM whatever the context (a captured graph cannot
    choose per length; slices past the context's end return at once)."""
    sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 2
    n = max(1, min(128, per_sm * sms // kv_heads))
    return 1 << (n.bit_length() - 1)  # a power of two: the combining kernel takes all slices as one tile


def dot_precision(dtype: torch.dtype) -> str:
    """fp32 queries are the exact (oracle) path: their dots stay fp32 instead of Triton's default TF32, which
    rounds to 10 mantissa bits (~1e-3 of the logits); half-precision dots ignore the setting."""
    return "ieee" if dtype == torch.float32 else "tf32"


_kernel = None


def _build():
    import triton
    import triton.language as tl

    global enter, quantize_groups  # a jit kernel finds the jit functions it calls among its module's globals
    from .pdl import enter
    from .rowquant import quantize_groups

    @triton.jit
    def attention_kernel(q_ptr, k_ptr, v_ptr, ks_ptr, vs_ptr, pos_ptr, table_ptr, o_ptr, lse_ptr, T, H, HKV, D,
               scale, WINDOW, G: tl.constexpr, SPLITS: tl.constexpr, QUANT: tl.constexpr, PAGE: tl.constexpr,
               WIDE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
               DOT: tl.constexpr, PDL: tl.constexpr):
        enter(PDL)
        hk, sp = tl.program_id(0), tl.program_id(1)
        rm = tl.arange(0, BLOCK_M)
        tok, head = rm // G, hk * G + rm % G  # row = (query token, query head of this KV head)
        row_ok = tok < T
        rd = tl.arange(0, BLOCK_D)
        d_ok = rd < D
        q = tl.load(q_ptr + (tok * H + head)[:, None] * D + rd[None, :], mask=row_ok[:, None] & d_ok[None, :],
                    other=0.0)
        qpos = tl.load(pos_ptr + tok, mask=row_ok, other=-1)
        length = tl.load(pos_ptr + T - 1) + 1
        per = tl.cdiv(tl.cdiv(length, BLOCK_N), SPLITS) * BLOCK_N
        # keys older than every query's window are skipped, in whole tiles: tiles start at multiples of BLOCK_N
        lo = tl.maximum(sp * per, tl.maximum(tl.load(pos_ptr) - WINDOW + 1, 0) // BLOCK_N * BLOCK_N)
        hi = tl.minimum(sp * per + per, length)
        m_i = tl.full((BLOCK_M,), -1.0e30, tl.float32)
        l_i = tl.zeros((BLOCK_M,), tl.float32)
        acc = tl.zeros((BLOCK_M, BLOCK_D), tl.float32)
        # An aligned tile no wider than a block lies in one block: one id per tile, loaded a tile ahead so its
        # latency hides behind the tile before (a load per key row was measurably slower). 64-bit offsets
        # only for stores of 2^31 elements per layer and more.
        blk = tl.load(table_ptr + lo // PAGE, mask=lo < hi, other=0)
        for n0 in range(lo, hi, BLOCK_N):
            rn = n0 + tl.arange(0, BLOCK_N)
            n_ok = rn < hi
            if PAGE % BLOCK_N == 0:
                row = (blk.to(tl.int64) if WIDE else blk) * PAGE + rn % PAGE
                blk = tl.load(table_ptr + (n0 + BLOCK_N) // PAGE, mask=n0 + BLOCK_N < hi, other=0)
            else:
                row = tl.load(table_ptr + rn // PAGE, mask=n_ok, other=0)
                row = (row.to(tl.int64) if WIDE else row) * PAGE + rn % PAGE
            offs = (row * HKV + hk)[:, None] * D + rd[None, :]
            tile_ok = n_ok[:, None] & d_ok[None, :]
            kt = tl.load(k_ptr + offs, mask=tile_ok, other=0.0)
            vt = tl.load(v_ptr + offs, mask=tile_ok, other=0.0)
            if QUANT:
                ks = tl.load(ks_ptr + row * HKV + hk, mask=n_ok, other=0.0)
                vs = tl.load(vs_ptr + row * HKV + hk, mask=n_ok, other=0.0)
                kt = (kt.to(tl.float32) * ks[:, None]).to(q.dtype)
                vt = (vt.to(tl.float32) * vs[:, None]).to(q.dtype)
            else:
                kt, vt = kt.to(q.dtype), vt.to(q.dtype)
            s = tl.dot(q, tl.trans(kt), input_precision=DOT) * scale
            visible = (rn[None, :] <= qpos[:, None]) & (rn[None, :] > qpos[:, None] - WINDOW) & n_ok[None, :]
            s = tl.where(visible, s, -1.0e30)
            m_new = tl.maximum(m_i, tl.max(s, 1))
            p = tl.where(visible, tl.exp(s - m_new[:, None]), 0.0)
            alpha = tl.exp(m_i - m_new)
            l_i = l_i * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None] + tl.dot(p.to(vt.dtype), vt, input_precision=DOT)
            m_i = m_new
        has = l_i > 0
        out = acc / tl.where(has, l_i, 1.0)[:, None]
        lse = tl.where(has, m_i + tl.log(tl.where(has, l_i, 1.0)), -float("inf"))
        rows = sp * T * H + tok * H + head
        tl.store(o_ptr + rows[:, None] * D + rd[None, :], out, mask=row_ok[:, None] & d_ok[None, :])
        tl.store(lse_ptr + rows, lse, mask=row_ok)

    @triton.jit
    def combine_kernel(o_ptr, lse_ptr, g_ptr, out_ptr, q_ptr, qs_ptr, qsum_ptr, TH, H, D, g_tok, g_head,
                       SPLITS: tl.constexpr, GATE: tl.constexpr, BLOCK_D: tl.constexpr, ROWS: tl.constexpr,
                       SPLIT: tl.constexpr, PDL: tl.constexpr):
        enter(PDL)
        row = tl.program_id(0)  # (token, head)
        rs = tl.arange(0, SPLITS)
        rd = tl.arange(0, BLOCK_D)
        d_ok = rd < D
        lse = tl.load(lse_ptr + rs * TH + row)
        w = tl.exp(lse - tl.max(lse, 0))  # split 0 always holds key 0, so the max is finite
        o = tl.load(o_ptr + (rs * TH + row)[:, None] * D + rd[None, :], mask=d_ok[None, :], other=0.0)
        dt = out_ptr.dtype.element_ty
        out = (tl.sum(o * w[:, None], 0) / tl.sum(w, 0)).to(dt)
        if GATE:  # gated attention's output gate, rounded as the reference's sigmoid and product are
            g = tl.load(g_ptr + (row // H) * g_tok + (row % H) * g_head + rd, mask=d_ok, other=0.0).to(tl.float32)
            out = (out.to(tl.float32) * (1.0 / (1.0 + tl.exp(-g))).to(dt).to(tl.float32)).to(dt)
        tl.store(out_ptr + row * D + rd, out, mask=d_ok)
        if ROWS:  # the output projection's int8 rows: token row // H, this head's groups of 64 (D % 64 == 0)
            quantize_groups(tl.reshape(out.to(tl.float32), (BLOCK_D // 64, 64)), (row % H) * (D // 64),
                            tl.arange(0, BLOCK_D // 64) < D // 64, row // H, H * D, q_ptr, qs_ptr, qsum_ptr, SPLIT,
                            BLOCK_D // 64)

    return attention_kernel, combine_kernel


def decode_attention(q: torch.Tensor, kv: KVCache, layer: int, positions: torch.Tensor,
                     scale: float, gate: torch.Tensor | None = None, window: int | None = None,
                     tile: Tile = Tile(), quant_split: bool | None = None) -> torch.Tensor | QuantRows:
    """q: [T, H, D]; query t sees keys 0..positions[t] (device; non-decreasing, the last one the newest key) of
    layer `layer`, which already holds them, or only the last `window` of those. Returns [T, H, D] in q's dtype,
    times sigmoid(gate) when a gate [T, H, D] (any strides but the last) is given. With `quant_split` set (and
    D a multiple of 64, T <= MAX_QUERY_TOKENS) it returns QuantRows of [T, H * D] instead: the output and the
    int8 rows of the matmul it feeds, written by the same kernel."""
    import triton

    from ..cache.kv_pool import PAGE
    from . import pdl

    global _kernel
    if _kernel is None:
        _kernel = _build()
    t, h, d = q.shape
    if quant_split is not None and (d % 64 or t > MAX_QUERY_TOKENS):
        quant_split = None
    if t > MAX_QUERY_TOKENS:  # a query sees keys up to its own position, so pieces of the queries are independent
        return torch.cat([decode_attention(q[i:i + MAX_QUERY_TOKENS], kv, layer, positions[i:i + MAX_QUERY_TOKENS],
                                           scale, gate[i:i + MAX_QUERY_TOKENS] if gate is not None else None,
                                           window, tile) for i in range(0, t, MAX_QUERY_TOKENS)])
    s = kv.store
    hkv = s.spec.heads
    g = h // hkv
    splits = splits_for(hkv, q.device, tile.per_sm)
    o = torch.empty(splits, t, h, d, dtype=torch.float32, device=q.device)
    lse = torch.empty(splits, t, h, dtype=torch.float32, device=q.device)
    attend, combine = _kernel
    attend[(hkv, splits)](q.contiguous(), s.k[layer], s.v[layer], *s.scales(layer), positions, kv.table.tensor, o,
                           lse, t, h, hkv, d, scale, window or 1 << 30, G=g, SPLITS=splits, QUANT=s.quantized,
                           PAGE=PAGE, WIDE=s.k[layer].numel() >= 1 << 31,
                           BLOCK_M=max(16, triton.next_power_of_2(t * g)), BLOCK_N=tile.block_n,
                           BLOCK_D=max(16, triton.next_power_of_2(d)), DOT=dot_precision(q.dtype),
                           num_warps=4 if d <= 128 else tile.warps, **pdl.launch(q))
    rows = empty_rows((t, h * d), q.dtype, q.device) if quant_split is not None else None
    out = rows.x.view(t, h, d) if rows is not None else torch.empty(t, h, d, dtype=q.dtype, device=q.device)
    g = out if gate is None else gate if gate.stride(-1) == 1 else gate.contiguous()
    r = rows if rows is not None else QuantRows(out, out, out, out)
    combine[(t * h,)](o, lse, g, out, r.codes, r.scales, r.sums, t * h, h, d, g.stride(0), g.stride(1), SPLITS=splits,
                      GATE=gate is not None, BLOCK_D=triton.next_power_of_2(d), ROWS=rows is not None,
                      SPLIT=bool(quant_split), num_warps=8, **pdl.launch(q))
    return rows if rows is not None else out
