"""Programmatic dependent launch (`engine.kernels.pdl`): on only for CUDA devices of sm_90 and newer (the users'
RTX 4090, sm_89, launches as before), off with NINFER_PDL=0, and the decode matmul's first weight tile is
requested before its grid-dependency wait. The kernels' results with PDL on are the GPU tests' (every kernel
test on an sm_90 device launches with it); each kernel's compile test checks the wait is in its sm_90 PTX and not
in its sm_89 PTX (`conftest.compile_ahead(pdl=True)`)."""
from __future__ import annotations

import re

import torch

from tests.conftest import compile_ahead


def test_pdl_only_where_the_gpu_has_it(monkeypatch):
    from engine.kernels import pdl

    assert pdl.launch(torch.zeros(2)) == {"PDL": False, "launch_pdl": False}
    cuda = torch.device("cuda", 0)
    monkeypatch.setattr(pdl, "_supported", lambda index: index == 0)  # as an sm_90 card at index 0
    assert pdl.launch(cuda) == {"PDL": True, "launch_pdl": True}
    assert not pdl.on(torch.device("cuda", 1))  # an older card beside it
    monkeypatch.setattr(pdl, "ENABLED", False)  # NINFER_PDL=0
    assert not pdl.on(cuda)


def test_decode_matmul_requests_weights_before_it_waits():
    from engine.kernels import qdot

    sig = {"xq_ptr": "*i32", "xs_ptr": "*fp32", "xsum_ptr": "*i32", "codes_ptr": "*i32", "high_ptr": "*u8",
           "scales_ptr": "*fp16", "out_ptr": "*fp32", **{a: "i32" for a in ("M", "N", "K", "code_stride",
                                                                             "high_stride", "scale_stride")}}
    consts = {"FMT": 4, "SPLIT": 1, "ROWS": 1, "ROWS_P2": 1, "BLOCK_N": 16, "GROUPS": 8, "USE_ASM": True}
    (sm90,) = compile_ahead(qdot.int8_dp4a_kernel, sig, consts, archs=(90,), pdl=True)
    wait = sm90.index("griddepcontrol.wait")
    loads = [m.start() for m in re.finditer(r"ld\.global", sm90)]
    assert any(i < wait for i in loads), "the first weight tile is loaded after the wait"
    assert any(i > wait for i in loads), "x's rows are read before the wait"
    assert sm90.index("griddepcontrol.launch_dependents") > wait


def test_verify_matmul_asks_l2_for_its_first_tiles_before_it_waits():
    from engine.kernels import qdot

    sig = {"xq_ptr": "*i8", "xs_ptr": "*fp32", "xsum_ptr": "*i32", "codes_ptr": "*u8", "high_ptr": "*u8",
           "scales_ptr": "*fp16", "out_ptr": "*fp32", **{a: "i32" for a in ("M", "N", "K", "code_stride",
                                                                             "high_stride", "scale_stride")}}
    consts = {"FMT": 4, "SPLIT": 1, "BLOCK_N": 64, "GROUPS": 4, "USE_ASM": True, "PREFETCH_LINES": 2}
    sm89, sm90 = compile_ahead(qdot.int8_mma_groups_kernel, sig, consts, pdl=True)
    # asked for before the wait, and only where PDL is on (sm_89 launches as before)
    assert 0 <= sm90.find("prefetch.global.L2") < sm90.index("griddepcontrol.wait")
    assert "prefetch.global.L2" not in sm89
