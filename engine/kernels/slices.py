"""A split-K matmul's fp32 K-slice partials (`qmatmul.SplitK`) summed as a Triton function (module-level, so other
kernels can call it): the sum kernel, the residual RMSNorm and the SwiGLU activation all read partials through it,
so they add in one order (from zero, slice by slice) and their sums agree to the bit."""
import triton
import triton.language as tl


@triton.jit
def summed_slices(ptr, offsets, mask, slice_stride, SLICES: tl.constexpr):
    """The fp32 sum over SLICES slices `slice_stride` elements apart of the values at `offsets` (masked to 0)."""
    acc = tl.zeros(offsets.shape, tl.float32)
    for s in tl.static_range(SLICES):
        acc += tl.load(ptr + s * slice_stride + offsets, mask=mask, other=0.0)
    return acc
