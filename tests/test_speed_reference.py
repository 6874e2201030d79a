"""The speed check's reference table (ninfer_tui/speed_references.json): ninfer's own rows per GPU and profile,
each measured or projected with its source, and the verdict they give (CPU only: no run, the table and the text)."""
from __future__ import annotations

import dataclasses
import importlib.util
import json
import sys

import pytest

from ninfer_tui import profiles
from ninfer_tui.speed_reference import REFERENCES, find, matching, reference_tokens, task_tokens
from ninfer_tui.speedcheck import SpeedReport, verdict

from .conftest import ROOT

H200, H100, RTX_4090 = "NVIDIA H200", "NVIDIA H100 80GB HBM3", "NVIDIA GeForce RTX 4090"


def test_an_h200_and_an_h100_find_ninfer_measured_rows():
    for gpu in (H200, H100):
        for spec in ("none", "mtp", "dflash"):
            ref = find(gpu, "8k-speed", spec)
            assert ref is not None and ref.kind == "measured", (gpu, spec)
            assert "measured" in ref.source and ref.extra["results_file"].startswith("bench_spec_")
            assert ref.decode_tok_s == pytest.approx(ref.tokens_per_round * 1e3 / ref.round_ms)
    # the row is the bench_spec.py run it names: the DFlash K=7 round at the reference's 5.17 tokens a round
    ref = find(H200, "8k-speed", "dflash")
    rows = json.loads((ROOT / "scripts" / "results" / ref.extra["results_file"]).read_text())
    row = next(r for r in rows if r["run"] == ref.extra["run"] and r["spec"] == "dflash" and r["K"] == 7)
    assert ref.round_ms == row["round_ms"] and ref.tokens_per_round == pytest.approx(1 + 7 * 0.596)
    assert find(H200, "8k-speed", "mtp").tokens_per_round == pytest.approx(reference_tokens("mtp", 3))


def test_an_rtx_4090_finds_the_projection_with_the_other_engine_beside_it():
    rows = matching(RTX_4090, "8k-speed", "dflash")
    assert [r.kind for r in rows] == ["projected", "other engine"]
    projected, other = rows
    assert find(RTX_4090, "8k-speed", "dflash") is projected and "PROJECTED" in projected.source
    assert other.decode_tok_s == 213.17 and projected.extra["results_file"] == "project_card.json"
    text = verdict(projected.decode_tok_s, projected, profiles.load("8k-speed"), [], rows)
    assert "PROJECTED (a model, not a measurement)" in text and "other engine's figure here: 213.2" in text
    assert "on par" in text
    assert find("NVIDIA A100-SXM4-80GB", "8k-speed", "dflash") is None  # no row: nothing invented


def test_every_row_is_labelled_and_sourced():
    for r in REFERENCES:
        assert r.kind in ("measured", "projected", "other engine") and r.source
        if r.kind == "projected":
            assert "PROJECTED" in r.source


def test_the_table_is_what_the_results_give():
    """The derived rows are those scripts/speed_reference_rows.py writes from scripts/results today."""
    spec = importlib.util.spec_from_file_location("speed_reference_rows", ROOT / "scripts" / "speed_reference_rows.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["speed_reference_rows"] = mod
    try:
        spec.loader.exec_module(mod)
        assert json.loads((ROOT / "ninfer_tui" / "speed_references.json").read_text()) == mod.table()
    finally:
        del sys.modules["speed_reference_rows"]


def test_lengths_and_report_fields():
    assert task_tokens(H200, "8k-speed", "dflash") == 4096  # no run of the task there: a GPU's default
    assert task_tokens(None, "cpu-default", "none") == 256
    names = {f.name for f in dataclasses.fields(SpeedReport)}
    assert {"reference_tok_s", "reference_source", "reference_kind", "references"} <= names


@pytest.mark.parametrize("module", ["speedcheck.py", "diagnose_cmd.py"])
def test_the_speed_check_restates_no_reference_figure(module):
    """The rows' run lengths and speeds live in speed_references.json alone: a figure copied into the speed check's
    text, help or comments goes stale when a row is measured again."""
    import io
    import re
    import tokenize

    from ninfer_tui import speedcheck

    figures = {str(r.new_tokens) for r in REFERENCES if r.new_tokens}
    figures |= {f"{r.decode_tok_s:.1f}" for r in REFERENCES} | {f"{r.decode_tok_s:.0f}" for r in REFERENCES}
    source = (ROOT / "ninfer_tui" / module).read_text()
    text = [t.string for t in tokenize.generate_tokens(io.StringIO(source).readline)
            if t.type in (tokenize.COMMENT, tokenize.STRING) and t.string.strip("\"'") != speedcheck.TASK]
    found = {n for piece in text for n in re.findall(r"\d+(?:\.\d+)?", piece)} & figures
    assert not found, f"{module} restates reference figures {sorted(found)}"
