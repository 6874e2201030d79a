"""The decode step's small kernels at the 27B sizes, per launch shape: the RMSNorm variants (warps per program, and
columns per program of a wide row), the GDN layer's conv step and recurrent update at T = 1 and 8 (channels or
value columns per program, warps) and decode attention over an 8K int8 KV cache (keys per iteration, warps,
programs per SM). Times are per call
inside a CUDA graph (what the decode graph pays), inputs cycled so reads come from HBM where they are large;
each result is checked against the default launch shape's output. The floor is bytes read and written over the
device copy rate measured in the same run.

Usage: python scripts/bench_step_kernels.py [--only norm|attention|mixer] [--context 8192] [--kv int8 bf16]
  [--tokens 1 8]  -> table + scripts/results/bench_step_kernels_<gpu>.json (or $OUT/; another --context:
  bench_step_kernels_ctx<context>_<gpu>.json)
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench_util import copy_bandwidth, fill_kv, gpu_name, time_graph_ms, write_results  # noqa: E402

from engine.cache.kv_cache import KVCache  # noqa: E402
from engine.cache.kv_pool import StoreSpec  # noqa: E402
from engine.kernels import norm  # noqa: E402
from engine.kernels.actquant import QuantRows  # noqa: E402
from engine.kernels.attention import Tile, decode_attention  # noqa: E402
from engine.kernels.conv import conv_update_  # noqa: E402
from engine.kernels.gdn import gdn_replay_, gdn_step_  # noqa: E402
from engine.kernels.qmatmul import SplitK  # noqa: E402
from engine.models.gdn import GDNHeads  # noqa: E402

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, GDN_HEADS, GDN_DIM, LAYERS = 5120, 24, 4, 256, 48, 128, 16
GDN_KEY_HEADS, CONV_WIDTH, GDN_LAYERS = 16, 4, 48
CONTEXT = 8192


def norm_cases(g: torch.Generator):
    """(name, bytes, fn(warps, slice_cols), whether the row is wide enough to be sliced) for the norm launches of
    a decode step (one token)."""
    bf = torch.bfloat16
    x, h = (torch.randn(1, HIDDEN, device="cuda", dtype=bf, generator=g) for _ in range(2))
    parts = SplitK(torch.randn(4, 1, HIDDEN, device="cuda", generator=g), bf, (1, HIDDEN))  # out proj, split 4
    w = torch.randn(HIDDEN, device="cuda", dtype=bf, generator=g) * 0.1
    o = torch.randn(1, GDN_HEADS, GDN_DIM, device="cuda", dtype=torch.float32, generator=g)
    z = torch.randn(1, GDN_HEADS, GDN_DIM, device="cuda", dtype=bf, generator=g)
    wg = torch.randn(GDN_DIM, device="cuda", dtype=bf, generator=g)
    q = torch.randn(1, HEADS, HEAD_DIM, device="cuda", dtype=bf, generator=g)
    wq = torch.randn(HEAD_DIM, device="cuda", dtype=bf, generator=g) * 0.1
    cos, sin = torch.randn(1, 64, device="cuda", dtype=bf), torch.randn(1, 64, device="cuda", dtype=bf)
    return [
        ("add 4 partials + norm + int8 rows", 2 * x.nbytes + parts.parts.nbytes + x.nbytes + x.numel(),
         lambda warps, cols: norm._launch(x, w, 1e-6, True, bf, residual=parts, quant_split=True, warps=warps,
                                          slice_cols=cols), True),
        ("add + norm + int8 rows (q5/q4 input)", 4 * x.nbytes + x.numel(),
         lambda warps, cols: norm._launch(x, w, 1e-6, True, bf, residual=h, quant_split=True, warps=warps,
                                          slice_cols=cols), True),
        ("add + norm (bf16 out)", 4 * x.nbytes,
         lambda warps, cols: norm._launch(x, w, 1e-6, True, bf, residual=h, warps=warps, slice_cols=cols), True),
        ("gdn gated norm + int8 rows", o.nbytes + 2 * z.nbytes + z.numel(),
         lambda warps, cols: norm._launch(o, wg, 1e-6, False, bf, gate=z, quant_split=True, warps=warps), False),
        ("q norm + rope (24 heads)", 2 * q.nbytes,
         lambda warps, cols: norm._launch(q, wq, 1e-6, True, bf, rope=(cos, sin, 64), warps=warps), False),
    ]


def attention_cache(kv_dtype: str, g: torch.Generator, context: int) -> KVCache:
    kv = KVCache.new(StoreSpec(LAYERS, KV_HEADS, HEAD_DIM, kv_dtype, torch.bfloat16), context, torch.device("cuda"))
    fill_kv(kv.store, g)
    return kv


def attention_sweep(kv: KVCache, t: int, g: torch.Generator, record, context: int) -> None:
    """Every attention tile for t query tokens at the last of `context` positions, cycling the 16 layers' KV
    (268 MB in int8 at 8K, more than L2)."""
    per_layer = sum(getattr(kv.store, name)[0].nbytes for name in kv.store.names())
    q = torch.randn(t, HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16, generator=g)
    gate = torch.randn(t, HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16, generator=g)
    pos = torch.arange(context - t, context, device="cuda")
    layer = [0]

    def step(tile: Tile):
        layer[0] = (layer[0] + 1) % LAYERS
        return decode_attention(q, kv, layer[0], pos, HEAD_DIM ** -0.5, gate, tile=tile)

    want = decode_attention(q, kv, 0, pos, HEAD_DIM ** -0.5, gate).float()
    for block_n in (32, 64, 128):
        for warps in (4, 8):
            for per_sm in (1, 2, 4, 8):
                tile = Tile(block_n, warps, per_sm)
                try:
                    got = decode_attention(q, kv, 0, pos, HEAD_DIM ** -0.5, gate, tile=tile).float()
                    ms = time_graph_ms(lambda tl=tile: step(tl))
                except Exception as e:  # noqa: BLE001 - a shape this GPU cannot compile (shared memory)
                    print(f"attention {tile}: {type(e).__name__}")
                    continue
                err = ((got - want).norm() / want.norm()).item()
                record("attention", f"{kv.store.spec.kv_dtype} KV, {context} keys, T={t}", str(tile), ms,
                       per_layer + 2 * q.nbytes + gate.nbytes, err)


def mixer_sweep(t: int, g: torch.Generator, record) -> None:
    """The GDN layer's conv step and recurrent update for t tokens (a verify step keeps its conv window and leaves
    the recurrent state as it was) over each launch shape, cycling the 48 layers' recurrent states (144 MB, more
    than L2); and the replay of a verify step's t tokens over all 48 layers at once (its commit)."""
    bf = torch.bfloat16
    heads = GDNHeads(GDN_KEY_HEADS, GDN_DIM, GDN_HEADS, GDN_DIM)
    channels = 2 * GDN_KEY_HEADS * GDN_DIM + GDN_HEADS * GDN_DIM
    keep = t > 1
    x = torch.randn(t, channels, device="cuda", dtype=bf, generator=g)
    conv_w = torch.randn(channels, CONV_WIDTH, device="cuda", dtype=bf, generator=g) * 0.5
    conv_states = [torch.randn(CONV_WIDTH - 1, channels, device="cuda", dtype=bf, generator=g)
                   for _ in range(GDN_LAYERS)]
    b, a = (torch.randn(t, GDN_HEADS, device="cuda", dtype=bf, generator=g) for _ in range(2))
    neg_a = -torch.rand(GDN_HEADS, device="cuda", generator=g) - 0.1
    dt_bias = torch.randn(GDN_HEADS, device="cuda", generator=g)
    stack = torch.randn(GDN_LAYERS, GDN_HEADS, GDN_DIM, GDN_DIM, device="cuda", generator=g) * 0.1
    states = list(stack)
    layer = [0]
    # what a verify step keeps for its commit (as KeptInputs holds it, one layer's slice)
    window = torch.empty(CONV_WIDTH - 1 + t, channels, device="cuda", dtype=bf) if keep else None

    def conv(block_c: int, warps: int):
        layer[0] = (layer[0] + 1) % GDN_LAYERS
        return conv_update_(x, conv_states[layer[0]], conv_w, window, block_c, warps)

    def gdn(block_v: int, warps: int, inputs_first: bool | None = None):
        layer[0] = (layer[0] + 1) % GDN_LAYERS
        return gdn_step_(x, b, a, neg_a, dt_bias, heads, states[layer[0]], keep, block_v, warps, inputs_first)

    # each call moves a state on, so outputs are compared on copies taken before the first call
    saved_conv, saved_gdn = conv_states[1].clone(), states[1].clone()
    window_bytes = x.nbytes + conv_states[0].nbytes if keep else 0  # the window a verify step writes
    conv_bytes = 2 * x.nbytes + 2 * conv_states[0].nbytes + conv_w.nbytes + window_bytes
    gdn_bytes = (1 if keep else 2) * states[0].nbytes + x.nbytes + t * GDN_HEADS * GDN_DIM * 4
    for name, fn, shapes, nbytes, saved, pool in (
            ("conv1d step", conv, ((128, 4), (64, 2), (64, 4), (256, 4), (128, 8)), conv_bytes, saved_conv,
             conv_states),
            ("gdn step", gdn, ((16, 1), (16, 2), (8, 1), (32, 4), (16, 1, True), (16, 1, False), (32, 4, True)),
             gdn_bytes, saved_gdn, states)):
        want = None  # the default shape's (listed first)
        for shape in shapes:
            pool[1].copy_(saved)
            layer[0] = 0
            got = fn(*shape).float()
            want = got if want is None else want
            err = ((got - want).norm() / want.norm()).item()
            case = f"27B, T={t}" + (", verify (state left)" if keep else "")
            order = "" if len(shape) < 3 else " inputs " + ("first" if shape[2] else "one ahead")  # else by T
            record(name, case, f"block={shape[0]} warps={shape[1]}{order}", time_graph_ms(lambda f=fn, s=shape: f(*s)),
                   nbytes, err)
    if keep:  # the commit of a verify step: its t tokens replayed into every layer's state, one launch
        inputs = x[None].expand(GDN_LAYERS, -1, -1).contiguous()
        gates = torch.stack([b, a])[None].expand(GDN_LAYERS, -1, -1, -1).contiguous()
        rates = neg_a[None].expand(GDN_LAYERS, -1), dt_bias[None].expand(GDN_LAYERS, -1)
        record("gdn replay", f"27B, {GDN_LAYERS} layers, keep={t}", "block=16 warps=1",
               time_graph_ms(lambda: gdn_replay_(inputs, gates, *rates, heads, stack, t)),
               2 * stack.nbytes + inputs.nbytes + gates.nbytes, 0.0)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--only", choices=["norm", "attention", "mixer"], help="one kernel family's launch shapes")
    p.add_argument("--context", type=int, default=CONTEXT, help="keys the attention sweep reads")
    p.add_argument("--kv", nargs="+", default=["int8", "bf16"], help="the attention sweep's KV formats")
    p.add_argument("--tokens", type=int, nargs="+", default=[1, 8], help="the attention sweep's query tokens")
    args = p.parse_args()
    only = args.only
    gpu, bw = gpu_name(), copy_bandwidth()
    g = torch.Generator(device="cuda").manual_seed(0)
    rows = []

    def record(kind: str, case: str, shape: str, ms: float, nbytes: int, err: float) -> None:
        floor = nbytes / bw * 1e3
        rows.append({"gpu": gpu, "kernel": kind, "case": case, "launch": shape, "us": ms * 1e3,
                     "floor_us": floor * 1e3, "ratio_to_floor": ms / floor, "rel_err_vs_default": err,
                     "copy_bw_gbs": bw / 1e9})
        print(f"{kind:9s} {case:40s} {shape:32s} {ms * 1e3:7.2f} us  floor {floor * 1e3:6.2f}  x{ms / floor:6.1f}"
              f"  err {err:.1e}")

    def first(out):
        return (out[0].x if isinstance(out[0], QuantRows) else out[0]).float()

    for case, nbytes, fn, wide in norm_cases(g) if only in (None, "norm") else []:
        want = first(fn(None, None))
        for cols in (256, 512, 1024, 8192) if wide else (None,):
            for warps in (1, 2, 4, 8, 16):
                err = ((first(fn(warps, cols)) - want).norm() / want.norm()).item()
                shape = f"warps={warps}" + (f" cols={cols}" if cols else "")
                record("rms norm", case, shape, time_graph_ms(lambda f=fn, w=warps, c=cols: f(w, c)), nbytes, err)

    for t in (1, 8) if only in (None, "mixer") else ():
        mixer_sweep(t, g, record)

    for kv_dtype in args.kv if only in (None, "attention") else ():
        kv = attention_cache(kv_dtype, g, args.context)
        for t in args.tokens:
            attention_sweep(kv, t, g, record, args.context)
        del kv
        torch.cuda.empty_cache()
    # another context's sweep gets a file of its own, so the 8K rows stay
    name = "bench_step_kernels" + ("" if args.context == CONTEXT else f"_ctx{args.context}")
    print("wrote", write_results(name, rows))


if __name__ == "__main__":
    main()
