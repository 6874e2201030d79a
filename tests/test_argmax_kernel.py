"""The argmax kernels (kernels/argmax.py) against torch's argmax on random logits, ties included (the first
maximum wins, within a piece and across pieces), and the greedy verdict of a speculative round against the rule
written out here: drafts are kept while each is its row's argmax; the token after them is the argmax of the row
of the first rejection, or of the last row. In the Triton interpreter on the CPU at small widths, and on a GPU
(NINFER_TEST_DEVICE=cuda) at the 27B model's vocabulary and past 64 pieces of 4096."""

import pytest

from .conftest import compile_ahead, defined, gpu_only, interpret

CHECK = """
import torch
from engine.kernels.argmax import greedy_verdict, row_argmax
from engine.runtime.request import SamplingParams
from engine.runtime.sampler import Sampler


def check(device, widths):
    g = torch.Generator().manual_seed(5)
    bad = 0
    for width in widths:
        for k in range(1, 8):
            logits = torch.randn(k + 1, width, generator=g)
            top = logits.max() + 1
            logits[0, [width // 3, width - 2]] = top  # tied maxima, far apart
            logits[k, [width // 2, width // 2 + 1]] = top  # tied neighbours
            if k > 2:
                logits[1] = 0.25  # a whole row tied
            best = logits.argmax(-1)
            for kept in range(k + 1):
                drafts = torch.randint(0, width, (k,), generator=g)
                drafts[:kept] = best[:kept]
                if kept < k and drafts[kept] == best[kept]:
                    drafts[kept] = (best[kept] + 1) % width
                want = [kept, int(best[kept])] + drafts.tolist()
                x, d = logits.to(device), drafts.to(device)
                bad += greedy_verdict(x, d).tolist() != want
                if width != widths[0]:  # the sampler's wiring (device and host drafts) runs that same launch
                    continue
                bad += Sampler(SamplingParams(temperature=0.0), width, x.device).accept(x, d) != (
                    kept, want[1], want[2:])
                bad += Sampler(SamplingParams(temperature=0.0), width, x.device).accept(x, d.tolist()) != (
                    kept, want[1], want[2:])
            bad += not torch.equal(row_argmax(logits.to(device).bfloat16()).cpu(), logits.bfloat16().argmax(-1))
            bad += not torch.equal(row_argmax(logits.to(device)).cpu(), best)
    return bad


def wide(device):
    # pieces wider than one load (past 64 x 4096): a tie across two loads of one piece goes to the first
    x = torch.randn(2, 300000, generator=torch.Generator().manual_seed(6))
    x[0, [4688 + 4100, 4688 + 10]] = x.max() + 1
    x[1, 299999] = x.max() + 1
    return int(not torch.equal(row_argmax(x.to(device)).cpu(), x.argmax(-1)))
"""


@pytest.mark.slow
def test_argmax_kernels_in_the_interpreter():
    assert interpret(CHECK + "print(check('cpu', [300, 5000, 9000]) + wide('cpu'))") == 0


@gpu_only
def test_argmax_kernels_on_the_gpu():
    namespace = defined(CHECK)
    assert namespace["check"]("cuda", [248320, 151936, 300000, 1000]) + namespace["wide"]("cuda") == 0


def test_argmax_kernels_compile_for_the_users_gpus():
    from engine.kernels import argmax

    piece_max, verdict = argmax._build()
    for logits in ("*fp32", "*bf16"):
        sig = {"x_ptr": logits, "val_ptr": "*fp32", "idx_ptr": "*i32", "width": "i32", "piece_width": "i32",
               "P": "i32"}
        for ptx in compile_ahead(piece_max, sig, {"BLOCK": 4096}):
            assert ".entry piece_max_kernel" in ptx
    sig = {"val_ptr": "*fp32", "idx_ptr": "*i32", "drafts_ptr": "*i64", "out_ptr": "*i64", "rows": "i32", "P": "i32",
           "k": "i32"}
    for ptx in compile_ahead(verdict, sig, {"ROWS": 8, "PIECES": 64, "VERDICT": True}, warps=1):
        assert ".entry verdict_kernel" in ptx
