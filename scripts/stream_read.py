"""The streaming-read kernel of `bench_util.read_rows` (a module of its own: Triton's jit wants its functions at
module level, and bench_util imports without Triton)."""
import triton
import triton.language as tl


@triton.jit
def read_kernel(src_ptr, out_ptr, n, BLOCK: tl.constexpr):
    r = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(out_ptr + tl.program_id(0), tl.sum(tl.load(src_ptr + r, mask=r < n, other=0), 0))
