"""The L2 prefetch (kernels/prefetch.py, the experiment of scripts/ab_step.py), in a launch of its own and
at the end of the one-row matmul's programs (v7 with PF): both compile for the users' GPUs with the prefetches
they are asked for, and a decode matmul that prefetches the next weight either way returns what it returns without
(in the interpreter, where the prefetch's PTX is left out, and on a GPU)."""

from .conftest import compile_ahead, gpu_only, interpret

SAME = """
import torch
from engine.quant.qweight import quantize
from engine.kernels import qmatmul


def same(device):
    g = torch.Generator().manual_seed(3)
    w = quantize(torch.randn(96, 1024, generator=g).to(device), "q5")
    nxt = quantize(torch.randn(64, 128, generator=g).to(device), "q4")
    x = torch.randn(1, 1024, generator=g).to(device)
    plain = qmatmul.qlinear(x, w)
    assert qmatmul.choose(1, x.dtype, x.device, w).version == "v7"
    w.prefetch = nxt.codes
    qmatmul.PREFETCH_BYTES = 1000  # fewer than the codes' bytes: the line count rounds up to whole lines
    ok = True
    for tail in (False, True):
        qmatmul.PREFETCH_IN_TAIL = tail
        ok &= torch.equal(qmatmul.qlinear(x, w), plain)
    return float(ok)
"""


def test_decode_matmul_with_prefetch_returns_the_same_in_the_interpreter():
    assert interpret(SAME + "print(same('cpu'))") == 1.0


@gpu_only
def test_decode_matmul_with_prefetch_on_the_gpu():
    namespace = {}
    exec(SAME, namespace)
    assert namespace["same"]("cuda") == 1.0


def test_prefetch_compiles_for_the_users_gpus():
    from engine.kernels import prefetch, qdot

    kernel = prefetch._build()
    for ptx in compile_ahead(kernel, {"ptr": "*u8", "n_lines": "i32"}, {"LINES": prefetch.LINES, "USE_ASM": True}):
        assert ptx.count("prefetch.global.L2::evict_last") == prefetch.LINES // 128  # lines per thread of 4 warps
    sig = {"xq_ptr": "*i32", "xs_ptr": "*fp32", "xsum_ptr": "*i32", "codes_ptr": "*i32", "high_ptr": "*u8",
           "scales_ptr": "*fp16", "out_ptr": "*fp32", "M": "i32", "N": "i32", "K": "i32", "code_stride": "i32",
           "high_stride": "i32", "scale_stride": "i32", "pf_ptr": "*u8", "pf_lines": "i32", "conv_w_ptr": "*fp32",
           "conv_state_ptr": "*fp32", "conv_channels": "i32"}
    consts = {"FMT": 5, "SPLIT": 2, "ROWS": 1, "ROWS_P2": 1, "BLOCK_N": 16, "GROUPS": 8, "USE_ASM": True, "SKIP": 0,
              "CONV": 0}
    for pf in (0, 1):
        for ptx in compile_ahead(qdot.kernel_rows, sig, consts | {"PF": pf}):
            assert ("prefetch.global.L2::evict_last" in ptx) == bool(pf)
