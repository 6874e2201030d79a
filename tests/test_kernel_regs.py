"""scripts/kernel_regs.py compiles the decode matmul ahead of time for the users' sm_89 with Triton's own ptxas (no
GPU) and reads its resources back: a register count a program of 4 warps can hold, and no spills at the shipped
one-row tile."""
import importlib.util
import shutil
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _tool(monkeypatch):
    pytest.importorskip("triton")
    monkeypatch.syspath_prepend(str(ROOT / "scripts"))  # as when run as a script: its helpers sit beside it
    spec = importlib.util.spec_from_file_location("kernel_regs", ROOT / "scripts" / "kernel_regs.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    if shutil.which(module.ptxas(89)) is None:
        pytest.skip("this Triton ships no ptxas")
    return module


def test_decode_matmul_resources_for_sm89(monkeypatch):
    kr = _tool(monkeypatch)
    from engine.kernels import qdot

    consts = {"FMT": 4, "SPLIT": 1, "BLOCK_N": 16, "GROUPS": 8, "USE_ASM": True, "PDL": False,
              "ROWS": 1, "ROWS_P2": 1}
    got = kr.resources(qdot.int8_dp4a_kernel, kr.signature("int8_dp4a", "q4"), consts, arch=89, warps=4, stages=2)
    assert 16 <= got["registers"] <= 255
    assert got["spill_store_bytes"] == 0
    assert got["shared_bytes"] >= 0
