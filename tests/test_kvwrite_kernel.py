"""The fused int8/fp8 KV write kernel against the reference (quantize_per_head, then a store at the positions)
on random k/v at scattered positions: in the Triton interpreter on the CPU (int8; the interpreter has no fp8),
and on a GPU (NINFER_TEST_DEVICE=cuda) for int8 and fp8 at the 27B model's attention geometry."""

import torch

from .conftest import gpu_only, interpret, rel_error


def worst_error(device: str, kv_dtypes, heads: int, dim: int) -> float:
    from engine.cache.kv_cache import KVCache, dequantize_per_head, quantize_per_head
    from engine.kernels.kvwrite import write_quantized

    g = torch.Generator(device=device).manual_seed(8)
    worst = 0.0
    for kv_dtype in kv_dtypes:
        for t in (1, 8, 5):
            cache = KVCache(2, 64, heads, dim, kv_dtype, torch.float32, torch.device(device))
            for name in cache._tensors():
                getattr(cache, name).view(torch.uint8).fill_(0)
            k = torch.randn(t, heads, dim, generator=g, device=device) * 3
            v = torch.randn(t, heads, dim, generator=g, device=device)
            pos = torch.randperm(64, generator=g, device=device)[:t]
            write_quantized(k, v, pos, cache.k[1], cache.v[1], cache.k_scale[1], cache.v_scale[1], kv_dtype)
            untouched = torch.ones(64, dtype=torch.bool, device=device)
            untouched[pos] = False
            for src, codes, scales in ((k, cache.k, cache.k_scale), (v, cache.v, cache.v_scale)):
                want = dequantize_per_head(*quantize_per_head(src, kv_dtype), torch.float32)
                got = dequantize_per_head(codes[1, pos], scales[1, pos], torch.float32)
                worst = max(worst, rel_error(got, want))
                assert not codes[1, untouched].view(torch.uint8).any() and not codes[0].view(torch.uint8).any()
    return worst


def test_kernel_matches_reference_in_the_interpreter():
    code = ("from tests.test_kvwrite_kernel import worst_error; "
            "print(worst_error('cpu', ['int8'], 2, 32))")
    assert interpret(code) < 1e-6


@gpu_only
def test_kernel_matches_reference_on_the_gpu():
    assert worst_error("cuda", ["int8"], 4, 256) < 1e-3
    # fp8 keeps 3 mantissa bits: where the kernel's division rounds a code's value the other way than torch's,
    # that element moves by one fp8 step (~6-12%); a few such elements in 8K give ~2e-3
    assert worst_error("cuda", ["fp8"], 4, 256) < 5e-3
