"""The top-k kernels (kernels/topk.py) against torch's topk on random logits: the values equal torch's, largest
first, and the ids are distinct columns of the row holding those values; ties at the k-th value, negative and
-inf logits (a row with fewer finite logits than k), k that is not a power of two, rows of one piece and of
several. In the Triton interpreter on the CPU at small widths, and on a GPU (NINFER_TEST_DEVICE=cuda) at the 27B
model's vocabulary through `rows.row_topk_ids`, as the sampler calls it."""

import pytest

from .conftest import compile_ahead, defined, gpu_only, interpret

CHECK = """
import torch
from engine.kernels import topk
from engine.models.rows import row_topk_ids


def check(device, widths, ks, rows=3):
    top = row_topk_ids if device == "cuda" else topk.row_topk_ids  # rows.row_topk_ids: torch's in the interpreter
    g = torch.Generator().manual_seed(8)
    bad = 0
    for width in widths:
        for k in ks:
            x = torch.randn(rows, width, generator=g) * 3
            x[0, torch.randperm(width, generator=g)[:k + 7]] = 2.5  # ties across the k-th value
            if rows > 1:
                x[1] = -torch.rand(width, generator=g) - 1  # all negative
            if rows > 2:
                x[2] = float("-inf")
                x[2, torch.randperm(width, generator=g)[:k // 2]] = torch.randn(k // 2, generator=g)
            assert topk.usable(x, k), (width, k)
            values, ids = top(x.to(device), k)
            values, ids = values.cpu(), ids.cpu()
            bad += not torch.equal(values, x.topk(k).values)
            bad += bool((ids < 0).any() or (ids >= width).any())
            if not bad:
                bad += not torch.equal(x.gather(1, ids), values)
            bad += sum(len(set(r.tolist())) != k for r in ids)
    return bad
"""


@pytest.mark.slow
def test_topk_kernels_in_the_interpreter():
    # pieces of 256 (8192 on a GPU), the narrowest that keeps 128 keys for k = 100 in a partial one: one partial,
    # one whole, two with a partial last (their merge); k of one, of a candidate set, and past it
    assert interpret(CHECK + "topk.PIECE = 256\nprint(check('cpu', [200, 256, 400], [1, 64, 100]))") == 0


@gpu_only
def test_topk_kernels_on_the_gpu():
    assert defined(CHECK)["check"]("cuda", [248320, 151936, 49152], [1, 20, 64, 100, 128], rows=8) == 0


@pytest.mark.slow
def test_topk_kernels_compile_for_the_users_gpus():
    from engine.kernels import topk

    piece, merge = topk._build()
    # the users' sm_89 alone: an 8192-wide sort takes ~45 s to compile per target, and the GPU tests compile sm_90
    for ptx in compile_ahead(piece, {"x_ptr": "*fp32", "key_ptr": "*i64", "width": "i32", "x_row": "i32"},
                             dict(K=64, BLOCK=8192), archs=(89,), warps=8):
        assert ".entry piece_topk_kernel" in ptx
    for ptx in compile_ahead(merge, {"key_ptr": "*i64", "val_ptr": "*fp32", "id_ptr": "*i64", "n": "i32", "k": "i32"},
                             dict(K=64, BLOCK=4096), archs=(89,), warps=8):
        assert ".entry merge_topk_kernel" in ptx
