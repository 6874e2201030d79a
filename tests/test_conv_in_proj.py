"""The GDN conv step in the in_proj matmul's programs (v7's CONV epilogue, `qmatmul.qlinear_conv`): against the
matmul alone followed by the torch reference of the conv step (`gdn.causal_conv1d`), on random weights, inputs,
states and conv weights: the same convolved features, the untouched features bit for bit, the same new state.
And inside the tiny hybrid model (in_proj widened to v7's 512-wide K tiles, the tile forced to v7 with no split):
decode steps with the flag on match those with it off. In the interpreter on the CPU, and on a GPU at the 27B's
in_proj width."""

from .conftest import compile_ahead, gpu_only, interpret

KERNEL = """
import torch
from engine.quant.qweight import quantize
from engine.kernels.qmatmul import ConvStep, QConfig, launch, qlinear_conv
from engine.models.gdn import causal_conv1d


def worst(device, dtype, n, c, k, fmt):
    g = torch.Generator().manual_seed(5)
    w = quantize(torch.randn(n, k, generator=g).to(device), fmt)
    x = torch.randn(1, k, generator=g).to(device, dtype)
    state = torch.randn(3, c, generator=g).to(device, dtype)
    cw = (torch.randn(c, 4, generator=g) * 0.5).to(device, dtype)
    cfg = QConfig("v7", 16, 512, 4, 2, 1)
    y = launch(x, w, cfg)
    want, window = causal_conv1d(y[:, :c].float(), state.float(), cw.float())
    moved = state.clone()
    got = launch(x, w, cfg, conv=ConvStep(moved, cw))
    err = ((got[:, :c].float() - want).norm() / want.norm()).item()
    exact = torch.equal(got[:, c:], y[:, c:]) and torch.equal(moved, window[1:].to(dtype))
    # qlinear_conv declines what v7's epilogue cannot serve: a K split, a state of another width
    declines = qlinear_conv(x, w, ConvStep(state[:, :c - 1].contiguous(), cw[:c - 1].contiguous())) is None
    return err if exact and declines else float("inf")
"""

MODEL = """
import os, torch
import engine.models.presets as p
p.TINY["hidden_size"] = 512
from engine import Engine, EngineConfig
from engine.config import WeightFormats
from engine.kernels import qmatmul
from engine.models import qwen3_5

chosen = qmatmul.choose
qmatmul.choose = lambda rows, dtype, device, w: qmatmul.QConfig("v7", 16, 512, 4, 2, 1) \\
    if rows == 1 and w.in_features % 512 == 0 else chosen(rows, dtype, device, w)
fused = []
convolve = qmatmul.qlinear_conv
qmatmul.qlinear_conv = lambda *a: fused.append(1) or convolve(*a)
eng = Engine(EngineConfig("synthetic:tiny", device="cpu", dtype="float32", kv_dtype="int8",
                          weights=WeightFormats(mlp="q8", gdn="q5")))
m = eng.model
ids = torch.randint(0, 256, (24,), generator=torch.Generator().manual_seed(7))
os.environ["NINFER_TRITON_ON_CPU"] = "1"


def run(on):
    qwen3_5.CONV_IN_PROJ = on
    cache = m.new_cache(64)
    with torch.inference_mode():
        m.forward(ids[:20], cache)  # prefill: the reference path either way (T > 8)
        steps = [m.forward(ids[i:i + 1], cache) for i in range(20, 24)]
    return torch.cat(steps + [cache.states.conv.flatten()[None, :512].float()], 1)


a, b = run(True), run(False)
print(((a - b).norm() / b.norm()).item() if fused else float("inf"))
"""


def test_conv_in_the_in_proj_matmul_in_the_interpreter():
    assert interpret(KERNEL + "print(max(worst('cpu', torch.float32, 208, 96, 1024, f) for f in ('q5', 'q4')))") \
        < 1e-5


def test_conv_in_the_in_proj_matmul_inside_the_model_in_the_interpreter():
    assert interpret(MODEL) < 1e-5


@gpu_only
def test_conv_in_the_in_proj_matmul_on_the_gpu():
    import torch

    namespace = {}
    exec(KERNEL, namespace)
    # the 27B's GDN in_proj: 10,240 convolved features of 16,480, K = 5120
    assert namespace["worst"]("cuda", torch.bfloat16, 16480, 10240, 5120, "q5") < 1e-2


def test_conv_epilogue_compiles_for_the_users_gpus():
    from engine.kernels import qdot

    sig = {"xq_ptr": "*i32", "xs_ptr": "*fp32", "xsum_ptr": "*i32", "codes_ptr": "*i32", "high_ptr": "*u8",
           "scales_ptr": "*fp16", "out_ptr": "*bf16", "M": "i32", "N": "i32", "K": "i32", "code_stride": "i32",
           "high_stride": "i32", "scale_stride": "i32", "conv_w_ptr": "*bf16",
           "conv_state_ptr": "*bf16", "conv_channels": "i32"}
    consts = {"FMT": 5, "SPLIT": 1, "ROWS": 1, "ROWS_P2": 1, "BLOCK_N": 32, "GROUPS": 8, "USE_ASM": True, "SKIP": 0,
              "CONV": 1}
    for ptx in compile_ahead(qdot.kernel_rows, sig, consts, warps=8):
        assert ".entry kernel_rows" in ptx and "ex2.approx" in ptx  # the SiLU's exp
