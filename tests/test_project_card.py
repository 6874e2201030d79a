"""scripts/project_card.py: the card projection reproduces its calibration card, scales with bandwidth as its
formula says, adds the PDL gap only where the calibration had PDL and the card has none, and its results file is
what it computes from the committed profiles (CPU, no GPU: it reads scripts/results)."""
from __future__ import annotations

import importlib.util
import json
import sys
from dataclasses import replace

import pytest

from .conftest import ROOT

REQUIRED = {"gpu", "projected", "calibrated_on", "spec", "K", "tokens_per_round", "round_ms", "tok_s", "step_ms"}


@pytest.fixture(scope="module")
def pc():
    spec = importlib.util.spec_from_file_location("project_card", ROOT / "scripts" / "project_card.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["project_card"] = mod  # its dataclasses look their module up
    spec.loader.exec_module(mod)
    yield mod
    del sys.modules["project_card"]


@pytest.mark.parametrize("which", [0, 1])
def test_projecting_a_card_onto_itself_gives_its_measurement(pc, which):
    cal = pc.CALIBRATIONS[which]
    rounds = pc.load_rounds(cal)
    step = next(r for r in rounds if r.spec == "none")
    card = pc.measured_card(cal.gpu)
    assert {r.spec for r in rounds} >= {"none", "dflash"}
    for r in rounds:
        p = pc.project(r, step, card, card, cal.pdl)
        assert p.round_ms == pytest.approx(r.round_ms, rel=1e-12)
        for name, c in r.classes.items():
            assert p.classes_us[name] == pytest.approx(c.us, rel=1e-12)


def test_half_the_bandwidth_doubles_the_weight_stream_and_not_the_latency_bound_kernels(pc):
    cal = pc.CALIBRATIONS[0]
    step = next(r for r in pc.load_rounds(cal) if r.spec == "none")
    card = pc.measured_card(cal.gpu)
    half = replace(card, bw=card.bw / 2)
    p = pc.project(step, step, card, half, cal.pdl)
    # the step's matmuls set the stream efficiency, so all of their time is bytes at that rate: twice as long
    assert p.classes_us["matmul"] == pytest.approx(2 * step.classes["matmul"].us, rel=1e-9)
    # the small kernels move ~nothing: their time stays their measured latency
    assert p.classes_us["small"] == pytest.approx(step.classes["small"].us, rel=0.01)
    # every class lies between unchanged and doubled; the gaps between kernels are carried over as they are
    for name, c in step.classes.items():
        assert c.us - 1e-9 <= p.classes_us[name] <= 2 * c.us + 1e-9
    assert p.overhead_ms == pytest.approx(step.round_ms - step.kernel_us / 1e3)


def test_pdl_gap_is_added_only_from_a_pdl_calibration_to_a_card_without_it(pc):
    cal = pc.CALIBRATIONS[1]
    step = next(r for r in pc.load_rounds(cal) if r.spec == "none")
    card = pc.measured_card(cal.gpu)
    no_pdl = replace(card, pdl=False)
    base = pc.project(step, step, card, no_pdl, pdl=False)
    with_gap = pc.project(step, step, card, no_pdl, pdl=True)
    assert with_gap.overhead_ms - base.overhead_ms == pytest.approx(step.launches * pc.pdl_gap_us(step) / 1e3)
    assert with_gap.overhead_ms > base.overhead_ms
    assert pc.project(step, step, card, card, pdl=True).round_ms == pytest.approx(step.round_ms)


def test_bytes_follow_the_shapes(pc):
    """The drafters' reads come on top of the target's; MTP reads the LM head once per draft step."""
    none, dflash, mtp = pc.round_bytes("none", 0), pc.round_bytes("dflash", 7), pc.round_bytes("mtp", 3)
    assert dflash["matmul"].bytes > none["matmul"].bytes and mtp["matmul"].bytes > dflash["matmul"].bytes
    assert dflash["gdn"].bytes == pytest.approx(1.5 * none["gdn"].bytes)  # verify reads, commit reads + writes
    # 16 attention layers x K and V x 4 KV heads x (256 int8 values + a 4-byte scale) per token of the context
    assert none["attention"].bytes == pc.CONTEXT * 16 * 2 * 4 * (256 + 4)


def test_results_file_is_what_the_committed_profiles_give(pc):
    rows = json.loads((ROOT / "scripts" / "results" / "project_card.json").read_text())
    fresh = [r for cal in pc.CALIBRATIONS for r in pc.rows_for(cal, pc.RTX_4090)] + pc.check_rows()
    assert [(r["gpu"], r["calibrated_on"], r["spec"], r["K"]) for r in rows] == \
        [(r["gpu"], r["calibrated_on"], r["spec"], r["K"]) for r in fresh]
    for old, new in zip(rows, fresh, strict=True):
        assert old["round_ms"] == pytest.approx(new["round_ms"]) and old["tok_s"] == pytest.approx(new["tok_s"])
    projected = [r for r in rows if not r.get("check")]
    assert projected and all(REQUIRED <= set(r) and r["projected"] is True for r in projected)
    assert all(r["gpu"] == "RTX 4090 (projected)" for r in projected)
    k7 = next(r for r in projected if r["spec"] == "dflash" and r["calibrated_on"].startswith("NVIDIA H100"))
    assert k7["K"] == 7 and k7["tokens_per_round"] == pytest.approx(1 + 7 * 0.596)
    checks = [r for r in rows if r.get("check")]
    assert {r["spec"] for r in checks} == {"none", "dflash"}
    for r in checks:
        assert r["calibrated_on"] == "NVIDIA H200" and r["gpu"].startswith("NVIDIA H100")
        assert r["error"] == pytest.approx(r["round_ms"] / r["measured_round_ms"] - 1)
