"""8-bit KV codes: per-(token, head) scales keep the rounding error at the format's resolution."""
import pytest
import torch

from engine.cache.kv_cache import dequantize_per_head, quantize_per_head


@pytest.mark.parametrize("kv_dtype,bound", [("int8", 0.5 / 127), ("fp8", 2.0**-4)])
def test_quantize_round_trip(kv_dtype, bound):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(37, 4, 64, generator=g) * torch.rand(37, 4, 1, generator=g) * 10
    codes, scale = quantize_per_head(x, kv_dtype)
    back = dequantize_per_head(codes, scale, torch.float32)
    # error per element relative to that head's absmax
    err = ((back - x).abs() / x.abs().amax(-1, keepdim=True)).max().item()
    assert err <= bound * 1.01, err
