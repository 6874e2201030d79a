"""The benchmarks' streaming-read kernel (`scripts/bench_util.read_rows`, the single-launch floor bench_qmatmul
reports beside each matmul) against torch, in the interpreter: it must read every word it is timed for."""

from .conftest import interpret

CHECK = """
import sys, torch
sys.path.insert(0, "scripts")
from bench_util import read_rows
x = torch.randint(-1000, 1000, (5000,), dtype=torch.int32, generator=torch.Generator().manual_seed(4))
got = read_rows(x, 1024)
want = torch.nn.functional.pad(x, (0, 5 * 1024 - 5000)).view(5, 1024).sum(1).int()
print(float(torch.equal(got, want)))
"""


def test_read_kernel_sums_every_word_in_the_interpreter():
    assert interpret(CHECK) == 1.0
