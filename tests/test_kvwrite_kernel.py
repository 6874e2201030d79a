"""The fused KV write kernel against the reference (quantize_per_head for int8/fp8, the values as they are
otherwise, stored at the rows the block table maps the positions to) on random k/v at scattered positions of a
cache whose blocks are scattered: in the Triton interpreter on the CPU (int8 and fp32; the interpreter has no
fp8), and on a GPU (NINFER_TEST_DEVICE=cuda) for int8, fp8 and bf16 at the 27B model's attention geometry."""

import torch

from .conftest import gpu_only, interpret, rel_error
from .test_kv_pool import scattered_cache


def worst_error(device: str, kv_dtypes, heads: int, dim: int) -> float:
    from engine.cache.kv_cache import dequantize_per_head, quantize_per_head
    from engine.kernels.kvwrite import write

    g = torch.Generator(device=device).manual_seed(8)
    worst = 0.0
    n = 200
    for kv_dtype in kv_dtypes:
        dtype = torch.bfloat16 if kv_dtype == "bf16" else torch.float32
        for t in (1, 8, 5):
            cache = scattered_cache(2, n, heads, dim, kv_dtype, dtype, device, seed=t)
            s = cache.store
            for name in s.names():
                getattr(s, name).view(torch.uint8).fill_(0)
            k = (torch.randn(t, heads, dim, generator=g, device=device) * 3).to(dtype)
            # v as the attention layer passes it: a slice of its fused projection, tokens further apart than H * D
            v = torch.randn(t, heads * dim + 5, generator=g, device=device).to(dtype)[:, 5:].reshape(t, heads, dim)
            pos = torch.randperm(n, generator=g, device=device)[:t]
            scales = (s.k_scale[1], s.v_scale[1]) if s.quantized else (s.k[1], s.v[1])
            write(k, v, pos, cache.table.tensor, s.k[1], s.v[1], *scales, kv_dtype)
            rows = cache.table.slots(pos)
            untouched = torch.ones(s.k.shape[1], dtype=torch.bool, device=device)
            untouched[rows] = False
            for src, codes, scales in ((k, s.k, s.k_scale if s.quantized else None),
                                       (v, s.v, s.v_scale if s.quantized else None)):
                if scales is None:
                    want, got = src.float(), codes[1, rows].float()
                else:
                    want = dequantize_per_head(*quantize_per_head(src, kv_dtype), torch.float32)
                    got = dequantize_per_head(codes[1, rows], scales[1, rows], torch.float32)
                worst = max(worst, rel_error(got, want))
                assert not codes[1, untouched].view(torch.uint8).any() and not codes[0].view(torch.uint8).any()
    return worst


def test_kernel_matches_reference_in_the_interpreter():
    code = ("from tests.test_kvwrite_kernel import worst_error; "
            "print(worst_error('cpu', ['int8', 'auto'], 2, 32))")
    assert interpret(code) < 1e-6


@gpu_only
def test_kernel_matches_reference_on_the_gpu():
    assert worst_error("cuda", ["int8"], 4, 256) < 1e-3
    assert worst_error("cuda", ["bf16"], 4, 256) == 0
    # fp8 keeps 3 mantissa bits: where the kernel's division rounds a code's value the other way than torch's,
    # that element moves by one fp8 step (~6-12%); a few such elements in 8K give ~2e-3
    assert worst_error("cuda", ["fp8"], 4, 256) < 5e-3
