"""scripts/bench_start.py: the start measurements run in a folder of their own (every cache and state dir moved
into it), and a real run on the CPU (synthetic:tiny, 64-token prompts) writes its rows beside the results file's
other rows."""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest

from .conftest import ROOT


def _module(name: str, monkeypatch):
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, name, mod)  # its dataclasses look their module up
    monkeypatch.syspath_prepend(str(ROOT / "scripts"))  # as when it runs: bench_util beside it
    spec.loader.exec_module(mod)
    return mod


def test_every_cache_and_state_dir_moves_into_the_runs_folder(tmp_path, monkeypatch):
    b = _module("bench_start", monkeypatch)
    env = b.isolated_env(tmp_path)
    for name in b.ISOLATED:
        assert env[name] == str(tmp_path / name.lower()), name
    assert {"TRITON_CACHE_DIR", "NINFER_CACHE_DIR", "NINFER_STATE_DIR", "HOME", "CUDA_CACHE_PATH"} <= set(b.ISOLATED)
    assert env["PYTHONUSERBASE"] and not env["PYTHONUSERBASE"].startswith(str(tmp_path))
    assert env["NINFER_MODELS_DIR"] == os.environ["NINFER_MODELS_DIR"]  # pulled models are read where they are
    prompts = [b.prompt(100, seed) for seed in range(4)]
    assert all(len(p) == 100 and max(p) < 256 for p in prompts)
    assert len({p[0] for p in prompts}) == 4 and b.prompt(100, 2) == prompts[2]


def test_results_merge_by_scenario(tmp_path, monkeypatch):
    monkeypatch.setenv("OUT", str(tmp_path))
    util = _module("bench_util", monkeypatch)
    path = util.write_results("bench_long", [{"scenario": "resume-held", "ttft_s": 1.0},
                                             {"scenario": "cold-start", "ttft_s": 9.0}], tag="cpu")
    util.write_results("bench_long", [{"scenario": "cold-start", "ttft_s": 2.0}], tag="cpu", merge_key="scenario")
    assert json.loads(path.read_text()) == [{"scenario": "resume-held", "ttft_s": 1.0},
                                            {"scenario": "cold-start", "ttft_s": 2.0}]
    util.write_results("bench_long", [{"scenario": "warm-start", "ttft_s": 1.5}], tag="cpu")  # without: replaced
    assert json.loads(path.read_text()) == [{"scenario": "warm-start", "ttft_s": 1.5}]


@pytest.mark.slow
def test_bench_start_runs_on_the_cpu(tmp_path):
    kept = {"scenario": "resume-held", "ttft_s": 1.0}
    (tmp_path / "bench_long_cpu.json").write_text(json.dumps([kept]))
    run = subprocess.run([sys.executable, "scripts/bench_start.py", "--context", "64", "--timeout", "120", "--",
                          "--model", "synthetic:tiny", "--device", "cpu"], cwd=ROOT, capture_output=True, text=True,
                         timeout=400, env={**os.environ, "OUT": str(tmp_path)})
    assert run.returncode == 0, run.stdout + run.stderr
    rows = json.loads((tmp_path / "bench_long_cpu.json").read_text())
    assert rows[0] == kept
    assert [r["scenario"] for r in rows[1:]] == ["cold-start", "warm-start", "first-prompt", "second-prompt"]
    for r in rows[1:]:
        assert r["gpu"] is None and r["context"] == 64 and r["model"] == "synthetic:tiny" and r["ttft_s"] > 0
    cold, warm = rows[1], rows[2]
    assert cold["wall_s"] >= cold["ttft_s"] and cold["prefill_tok_s"] > 0 and warm["prefill_tok_s"] > 0
    assert rows[3]["load_s"] > 0 and rows[4]["first_over_second"] > 0
