"""The decode/verify attention kernel against its torch reference (causal attention over the dequantized
prefix) on random KV whose blocks are scattered over the pool: in the Triton interpreter on the CPU at small
sizes, on a GPU (NINFER_TEST_DEVICE=cuda or scripts/gpu_kernels.py) at the 27B model's sizes."""

import pytest
import torch

from .conftest import compile_ahead, gpu_only, interpret, rel_error
from .test_kv_pool import scattered_cache

# (query tokens, query heads, kv heads, head dim, context before the step, KV format)
SMALL = [(1, 4, 2, 64, 0, "auto"), (1, 6, 2, 48, 150, "int8"), (3, 3, 3, 64, 70, "auto"), (8, 4, 1, 32, 200, "int8"),
         (5, 8, 2, 64, 129, "bf16"), (13, 4, 2, 32, 40, "int8")]  # 13: a prefill piece, two launches
REAL = [(t, 24, 4, 256, ctx, kv) for t in (1, 8, 16) for ctx in (100, 8191, 65536) for kv in ("bf16", "int8", "fp8")]


def worst_error(device: str, cases, dtype: torch.dtype = torch.float32, block_n: int = 32) -> float:
    """The largest relative error of the kernel against the reference over `cases` (random q, k, v), with key
    tiles of `block_n` rows (wider than a block: each row's block looked up)."""
    from engine.kernels.attention import Tile, decode_attention
    from engine.models.layers import causal_attention

    g = torch.Generator(device=device).manual_seed(3)
    worst = 0.0
    for t, h, hkv, d, ctx, kv_dtype in cases:
        kv = scattered_cache(1, ctx + t + 5, hkv, d, kv_dtype, dtype, device)
        keys = torch.randn(ctx + t, hkv, d, generator=g, device=device, dtype=dtype)
        values = torch.randn(ctx + t, hkv, d, generator=g, device=device, dtype=dtype)
        kv.write(0, torch.arange(ctx + t, device=device), keys, values)
        q = torch.randn(t, h, d, generator=g, device=device, dtype=dtype)
        positions = torch.arange(ctx, ctx + t, device=device)
        got = decode_attention(q, kv, 0, positions, d ** -0.5, tile=Tile(block_n=block_n)).float()
        k_ref, v_ref = kv.read(0, ctx + t)
        want = causal_attention(q.float(), k_ref.float(), v_ref.float(), ctx, d ** -0.5)
        # gated attention's output gate, a strided [T, H, D] slice of the query projection as the model passes it
        gate = torch.randn(t, h, 2 * d, generator=g, device=device, dtype=dtype)[..., d:] * 2
        gated = decode_attention(q, kv, 0, positions, d ** -0.5, gate, tile=Tile(block_n=block_n)).float()
        worst = max(worst, rel_error(got, want), rel_error(gated, want * torch.sigmoid(gate.float())))
        worst = max(worst, rows_mismatch(q, kv, positions, gate, Tile(block_n=block_n), gated))
    return worst


def rows_mismatch(q, kv, positions, gate, tile, gated) -> float:
    """1.0 unless the output written with the next matmul's int8 rows (both row layouts) is the plain output and
    its rows are what the separate quantizer makes of it (heads of 64-multiple width, T <= 8; else a plain
    tensor comes back)."""
    from engine.kernels.actquant import QuantRows, quantize_rows
    from engine.kernels.attention import MAX_QUERY_TOKENS, decode_attention

    t, h, d = q.shape
    for split in (False, True):
        out = decode_attention(q, kv, 0, positions, d ** -0.5, gate, tile=tile, quant_split=split)
        if d % 64 or t > MAX_QUERY_TOKENS:
            if isinstance(out, QuantRows) or not torch.equal(out.float(), gated):
                return 1.0
            continue
        if not torch.equal(out.x.float(), gated.reshape(t, h * d)):
            return 1.0
        if not all(torch.equal(a, b) for a, b in zip((out.codes, out.scales, out.sums), quantize_rows(out.x, split),
                                                      strict=True)):
            return 1.0
    return 0.0


def worst_block_error(device: str, dtype: torch.dtype, t: int, h: int, hkv: int, d: int, ctx: int,
                      window: int) -> float:
    """A DFlash block through the kernel: t queries after ctx context keys, non-causal (every query at the
    block's last position) and causal within a sliding window, against the drafter's reference attention."""
    from engine.kernels.attention import decode_attention
    from engine.models.dflash import _block_attention

    g = torch.Generator(device=device).manual_seed(5)
    kv = scattered_cache(1, ctx + t + 3, hkv, d, "auto", dtype, device)
    keys = torch.randn(ctx + t, hkv, d, generator=g, device=device, dtype=dtype)
    values = torch.randn(ctx + t, hkv, d, generator=g, device=device, dtype=dtype)
    kv.write(0, torch.arange(ctx + t, device=device), keys, values)
    q = torch.randn(t, h, d, generator=g, device=device, dtype=dtype)
    pos = torch.arange(ctx, ctx + t, device=device)
    worst = 0.0
    for causal, win in ((False, None), (True, window)):
        want = _block_attention(q.float(), keys.float(), values.float(), pos, 0, causal, win, d ** -0.5)
        seen = pos if causal else torch.full_like(pos, ctx + t - 1)
        got = decode_attention(q, kv, 0, seen, d ** -0.5, window=win)
        worst = max(worst, rel_error(got, want))
    return worst


def test_block_attention_matches_reference_in_the_interpreter():
    code = ("from tests.test_attention_kernel import worst_block_error; import torch; "
            "print(worst_block_error('cpu', torch.float32, 16, 4, 2, 32, 150, 40))")
    assert interpret(code) < 1e-5


@gpu_only
def test_block_attention_matches_reference_on_the_gpu():
    assert worst_block_error("cuda", torch.bfloat16, 16, 32, 8, 128, 8191, 2048) < 2e-2


@pytest.mark.slow
def test_kernel_matches_reference_in_the_interpreter():
    code = ("from tests.test_attention_kernel import SMALL, worst_error; "
            "print(max(worst_error('cpu', SMALL), worst_error('cpu', SMALL, block_n=128)))")
    assert interpret(code) < 1e-5


@gpu_only
def test_kernel_matches_reference_on_the_gpu():
    # 128-key tiles (a block id per key row) at one query token: at 8 and 16 the tiles of 256-dim heads need more
    # shared memory than Hopper has (NOTES (4)), which is why the shipped tile is 32 keys
    one_token = [c for c in REAL if c[0] == 1]
    assert max(worst_error("cuda", REAL, torch.bfloat16), worst_error("cuda", one_token, torch.bfloat16, 128)) < 2e-2


def test_combine_kernel_with_int8_rows_compiles_for_the_users_gpus():
    from engine.kernels import attention

    combine = attention._build()[1]
    sig = {"o_ptr": "*fp32", "lse_ptr": "*fp32", "g_ptr": "*bf16", "out_ptr": "*bf16", "q_ptr": "*i8",
           "qs_ptr": "*fp32", "qsum_ptr": "*i32", **{a: "i32" for a in ("TH", "H", "D", "g_tok", "g_head")}}
    for split in (False, True):
        consts = dict(SPLITS=32, GATE=True, BLOCK_D=256, ROWS=True, SPLIT=split)
        for ptx in compile_ahead(combine, sig, consts, warps=8, pdl=True):
            assert ".entry combine_kernel" in ptx


def test_fp32_queries_take_exact_dots():
    """fp32 runs are the oracle path on a GPU too: their dots must not round through TF32 (Triton's default for
    fp32 operands). bf16 keeps its tensor-core dots."""
    from engine.kernels import attention

    attend = attention._build()[0]
    sig = {p: "*fp32" for p in ("q_ptr", "k_ptr", "v_ptr", "ks_ptr", "vs_ptr", "o_ptr", "lse_ptr")}
    sig.update(pos_ptr="*i64", table_ptr="*i32", scale="fp32", **{a: "i32" for a in ("T", "H", "HKV", "D", "WINDOW")})
    consts = dict(G=6, SPLITS=8, QUANT=False, PAGE=256, WIDE=False, BLOCK_M=16, BLOCK_N=32, BLOCK_D=64)
    exact = compile_ahead(attend, sig, {**consts, "DOT": attention.dot_precision(torch.float32)}, pdl=True)
    default = compile_ahead(attend, sig, {**consts, "DOT": "tf32"}, pdl=True)
    assert all("tf32" not in ptx for ptx in exact)
    assert all("tf32" in ptx for ptx in default)  # what the setting guards against
    half = {**sig, **{p: "*bf16" for p in ("q_ptr", "k_ptr", "v_ptr")}}
    assert all("mma.sync" in ptx for ptx in compile_ahead(attend, half, {**consts, "DOT": attention.dot_precision(
        torch.bfloat16)}, pdl=True))
