"""The whole decode/verify step on the kernel path (attention, GDN, RMSNorm, quantized matmul kernels run by
the Triton interpreter on the CPU) against the same step on the torch reference path, on the tiny hybrid model
with int8 KV and q8 weights: the kernels agree with their references inside a real model, not only alone. Where
the chosen matmul multiplies int8 activation rows (every kernel but float_mma), the reference path multiplies the
same rows."""

from .conftest import interpret

CHECK = """
import os, torch
from engine import Engine, EngineConfig
from engine.config import WeightFormats
from engine.kernels import qmatmul
from engine.kernels.actquant import dequantize_rows, quantize_rows_reference
plain = qmatmul.qlinear_reference

def as_the_kernel_computes(x, w):
    rows = x.reshape(-1, x.shape[-1])
    if rows.shape[0] > qmatmul.MAX_ROWS or not qmatmul.choose(rows.shape[0], x.dtype, x.device, w).int8_rows:
        return plain(x, w)  # prefill, or a float-row kernel
    split = qmatmul.split_rows(w)
    codes, scales, _ = quantize_rows_reference(x.reshape(-1, x.shape[-1]), split)
    return plain(dequantize_rows(codes, scales, split).reshape(x.shape), w)

qmatmul.qlinear_reference = as_the_kernel_computes
eng = Engine(EngineConfig("synthetic:tiny", device="cpu", dtype="float32", kv_dtype="int8",
                          weights=WeightFormats(mlp="q8", gdn="q8")))
m = eng.model
ids = torch.randint(0, 256, (30,), generator=torch.Generator().manual_seed(7))

def run(kernels):
    os.environ["NINFER_TRITON_ON_CPU"] = "1" if kernels else "0"
    cache = m.new_cache(64)
    with torch.inference_mode():
        m.forward(ids[:20], cache)  # prefill: reference ops either way (T > 8)
        one = m.forward(ids[20:21], cache)  # a decode step
        verify = m.forward(ids[21:26], cache, all_logits=True, keep_inputs=True)  # a verify step
        cache.commit(5, 2)
        after = m.forward(ids[26:27], cache)  # after a rollback to 2 of the 5
    return torch.cat([one, verify, after])

a, b = run(True), run(False)
print(((a - b).norm() / b.norm()).item())
"""


def test_decode_and_verify_steps_on_the_kernel_path_match_the_reference_in_the_interpreter():
    assert interpret(CHECK) < 1e-4


def test_attention_writing_the_output_projections_int8_rows_in_the_interpreter():
    """Heads of 64 dims (the 27B's are 256) and q4 attention weights: the attention kernel then writes the o
    projection's int8 rows (even/odd planes) with its output, and the step still matches the reference path."""
    code = "import engine.models.presets as p; p.TINY['head_dim'] = 64\n" + CHECK.replace(
        'WeightFormats(mlp="q8", gdn="q8")', 'WeightFormats(mlp="q8", gdn="q8", attn="q4")')
    assert interpret(code) < 1e-4


def test_gdn_step_writing_the_out_projections_int8_rows_in_the_interpreter():
    """Value heads of 64 dims (the 27B's are 128): the GDN step kernel then applies the output gate and writes the
    out projection's int8 rows itself, and the step still matches the reference path."""
    code = "import engine.models.presets as p; p.TINY['linear_value_head_dim'] = 64\n" + CHECK
    assert interpret(code) < 1e-4
