"""The fused RMSNorm kernel against the torch reference on random rows, both weight orders, and its fused
variants (residual add before, SiLU gate after, per-head norm + partial RoPE on strided views of a projection,
q's and k's heads in one launch):
in the Triton interpreter on the CPU, on a GPU (NINFER_TEST_DEVICE=cuda) in bf16 at the 27B model's widths."""

import torch

from .conftest import compile_ahead, gpu_only, interpret, rel_error


def worst_error(device: str, dtype: torch.dtype, widths) -> float:
    from engine.kernels.norm import add_rms_norm
    from engine.models.layers import rms_norm_reference

    g = torch.Generator(device=device).manual_seed(6)
    worst = 0.0
    for rows, d in widths:
        x = (torch.randn(rows, d, generator=g, device=device) * 3).to(dtype)
        w = (torch.randn(d, generator=g, device=device) * 0.2).to(dtype)
        for zc in (True, False):
            got, want = add_rms_norm(x, None, w, 1e-6, zc)[1].float(), rms_norm_reference(x, w, 1e-6, zc).float()
            worst = max(worst, rel_error(got, want))
    return worst


def worst_fused_error(device: str, dtype: torch.dtype, tokens: int, heads: int, d: int, rot: int) -> float:
    """add + norm, gated norm and norm + RoPE against their references (layers.py's torch branches)."""
    import torch.nn.functional as F

    from engine.kernels import norm
    from engine.kernels.qmatmul import SplitK
    from engine.models.layers import Rope, rms_norm_reference
    from engine.models.spec import RopeSpec

    g = torch.Generator(device=device).manual_seed(7)

    def rand(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g, device=device) * scale).to(dtype)

    worst = 0.0
    w = rand(d, scale=0.2)
    for zc in (True, False):
        x, r = rand(tokens, heads * d, scale=3), rand(tokens, heads * d)
        wide = rand(heads * d, scale=0.2)
        summed, normed = norm.add_rms_norm(x, r, wide, 1e-6, zc)
        want_sum = x + r
        worst = max(worst, rel_error(summed, want_sum), rel_error(normed, rms_norm_reference(want_sum, wide, 1e-6, zc)))
        # the residual as a split-K matmul's unsummed fp32 partials
        parts = torch.randn(3, tokens, heads * d, generator=g, device=device)
        summed, normed = norm.add_rms_norm(x, SplitK(parts, dtype, (tokens, heads * d)), wide, 1e-6, zc)
        want_sum = x + parts.sum(0).to(dtype)
        worst = max(worst, rel_error(summed, want_sum), rel_error(normed, rms_norm_reference(want_sum, wide, 1e-6, zc)))
        # q/k heads as the attention layer slices them from its fused projection: strided, not copied
        proj = rand(tokens, heads * 3 * d, scale=2)
        heads_view = proj[:, : heads * 2 * d].reshape(tokens, heads, 2 * d)[..., :d]
        rope = Rope(RopeSpec(theta=10000.0, rotary_dim=rot), d, torch.device(device))
        cos, sin = rope.cos_sin(torch.arange(5, 5 + tokens, device=device), dtype)
        got = norm.rms_norm_rope(heads_view, w, 1e-6, zc, cos, sin, rot)
        want = rope.apply(rms_norm_reference(heads_view, w, 1e-6, zc), cos, sin)
        worst = max(worst, rel_error(got, want))
        # q's heads and k's (fewer, with their own weight, from the same projection) in one launch
        k_view = proj[:, heads * 2 * d: heads * 2 * d + d].reshape(tokens, 1, d)
        k_weight = rand(d, scale=0.2)
        got_q, got_k = norm.rms_norm_rope_pair(heads_view, k_view, w, k_weight, 1e-6, zc, cos, sin, rot)
        want_k = rope.apply(rms_norm_reference(k_view, k_weight, 1e-6, zc), cos, sin)
        worst = max(worst, rel_error(got_q, want), rel_error(got_k, want_k))
    # the GDN output gate: fp32 read-out [T, H, D], z a strided slice of the projection
    out = torch.randn(tokens, heads, d, generator=g, device=device) * 2
    z = rand(tokens, heads * d + 7, scale=2)[:, 7:].reshape(tokens, heads, d)
    got = norm.gated_rms_norm(out, z, w, 1e-6, dtype)
    want = (rms_norm_reference(out.to(dtype), w, 1e-6) * F.silu(z.float())).to(dtype)
    return max(worst, rel_error(got, want.reshape(tokens, heads * d)))


def test_kernel_matches_reference_in_the_interpreter():
    code = ("import torch; from tests.test_norm_kernel import worst_error; "
            "print(worst_error('cpu', torch.float32, [(1, 64), (5, 96), (3, 576)]))")
    assert interpret(code) < 1e-6


# rows wider than this many columns are written by several programs (norm.SLICE_COLS): set low so that the
# interpreter's small rows are sliced too
SLICED = "import engine.kernels.norm as n; n.SLICE_COLS = 128; "


def test_fused_variants_match_reference_in_the_interpreter():
    # the last: rows sliced by their width, but enough of them for a program to take each whole (norm.WHOLE_ROWS)
    for setup in ("", SLICED, SLICED + "n.WHOLE_ROWS = 4; "):
        code = (setup + "import torch; from tests.test_norm_kernel import worst_fused_error; "
                "print(max(worst_fused_error('cpu', torch.float32, 3, 2, 32, 8), "
                "worst_fused_error('cpu', torch.float32, 1, 3, 64, 64)))")
        assert interpret(code) < 1e-6


@gpu_only
def test_kernel_matches_reference_on_the_gpu():
    # bf16 outputs: one rounding apart at most where the fp32 sums differ in order
    widths = [(1, 5120), (8, 5120), (2048, 5120), (8 * 24, 256), (8 * 48, 128)]
    assert worst_error("cuda", torch.bfloat16, widths) < 4e-3
    assert worst_fused_error("cuda", torch.bfloat16, 2048, 1, 5120, 64) < 4e-3  # a prefill chunk's residual norm
    assert worst_fused_error("cuda", torch.bfloat16, 8, 24, 256, 64) < 4e-3
    assert worst_fused_error("cuda", torch.bfloat16, 1, 48, 128, 128) < 4e-3


def quantized_rows_mismatch(device: str, dtype: torch.dtype, hidden: int, heads: int,
                            head_dim: int) -> tuple[float, float, float]:
    """Producers that also write the int8 rows of the matmul they feed, against the separate quantizer kernel on
    their output: (largest code difference, largest scale difference, fraction of codes that differ)."""
    from engine.kernels import activation, norm
    from engine.kernels.actquant import quantize_rows

    g = torch.Generator(device=device).manual_seed(10)

    def rand(*shape):
        return (torch.randn(*shape, generator=g, device=device) * 2).to(dtype)

    code, scale, differ = 0.0, 0.0, 0.0
    for split in (False, True):
        made = [norm.add_rms_norm(rand(3, hidden), rand(3, hidden), rand(hidden), 1e-6, True, split)[1],
                norm.add_rms_norm(rand(1, hidden), None, rand(hidden), 1e-6, False, split)[1],
                norm.gated_rms_norm(torch.randn(2, heads, head_dim, generator=g, device=device),
                                    rand(2, heads, head_dim), rand(head_dim), 1e-6, dtype, split),
                activation.silu_mul(rand(2, 2 * hidden), split)]
        for q in made:
            codes, scales, _ = quantize_rows(q.x.reshape(-1, q.x.shape[-1]).contiguous(), split)
            diff = (codes.int() - q.codes.int()).abs()
            code = max(code, diff.max().item())
            scale = max(scale, (scales - q.scales).abs().max().item())
            differ = max(differ, (diff > 0).float().mean().item())
    return code, scale, differ


def test_int8_rows_written_by_producers_match_the_quantizer_in_the_interpreter():
    for setup in ("", SLICED):
        code = (setup + "import torch; from tests.test_norm_kernel import quantized_rows_mismatch; "
                "print(sum(quantized_rows_mismatch('cpu', torch.float32, 192, 3, 64)))")
        assert interpret(code) == 0.0


@gpu_only
def test_int8_rows_written_by_producers_match_the_quantizer_on_the_gpu():
    # the same scales; a code may sit one step apart where x * 127 / absmax lands on a .5 tie (the compiler may
    # contract the scaling and the +0.5 into one FMA in one kernel and not in the other); 5120-wide rows are
    # written by several programs each
    code, scale, differ = quantized_rows_mismatch("cuda", torch.bfloat16, 5120, 48, 128)
    assert code <= 1 and scale == 0.0 and differ < 1e-3


def test_pair_launch_compiles_for_the_users_gpus():
    """The q/k pair selects its row's tensor and weight pointers at run time: it compiles ahead of time for the
    RTX 4090 and the H200."""
    from engine.kernels import norm

    sig = {f"{p}_ptr": "*bf16" for p in ("x", "r", "s", "z", "cos", "sin", "w", "o")}
    sig.update({"q_ptr": "*i8", "qs_ptr": "*fp32", "qsum_ptr": "*i32"})
    sig.update({a: "i32" for a in ("D", "HEADS", "ROT")}, eps="fp32")
    sig.update({a: "i32" for a in ("x_tok", "x_head", "z_tok", "z_head", "r_slice")})
    sig.update({"x2_ptr": "*bf16", "w2_ptr": "*bf16"}, **{a: "i32" for a in ("HEADS2", "x2_tok", "x2_head", "ROWS1")})
    consts = dict(ZERO_CENTRED=True, RESIDUAL=0, GATE=False, ROPE=True, QUANT=False, SPLIT=False, BLOCK_D=256,
                  SLICE=256, PAIR=True)
    for ptx in compile_ahead(norm._build(), sig, consts, warps=1, pdl=True):
        assert ".entry rms_norm_kernel" in ptx
