"""scripts/bench_serve.py: its statistics, and a real run against `ninfer serve` of the default model on the CPU
(the smallest workload: concurrency 1 and 2, one request each, 4 tokens, prompts cut to 48 tokens)."""
from __future__ import annotations

import importlib.util
import json
import subprocess
import sys

from .conftest import ROOT

REQUIRED = ("gpu", "profile", "spec", "draft_tokens", "acceptance", "concurrency", "aggregate_tok_s", "ttft_p50_s",
            "ttft_p99_s", "itl_p50_ms", "itl_p99_ms", "scenario", "date", "command", "settings")


def _bench(monkeypatch):
    spec = importlib.util.spec_from_file_location("bench_serve", ROOT / "scripts" / "bench_serve.py")
    mod = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "bench_serve", mod)  # its dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


def test_percentiles_and_per_token_latency(monkeypatch):
    b = _bench(monkeypatch)
    assert b.pct([], 50) is None
    assert b.pct([1.0, 2.0, 3.0, 4.0], 50) == 2.5 and b.pct([5.0], 99) == 5.0
    # one token, then a burst of three (a speculative round) 0.3 s later, then one 0.1 s after that
    samples = b.itl_samples([0.0, 0.3, 0.3002, 0.3004, 0.4004], burst_s=0.001)
    assert [round(s[2], 4) for s in samples] == [0.1001, 0.1001, 0.1001, 0.1]
    assert samples[0][:2] == (0.0, 0.3004)
    # the workload is the same for the same seed
    assert b.body_text("code", 7, 500) == b.body_text("code", 7, 500) != b.body_text("code", 8, 500)
    assert "LRUCache" in b.speedcheck_task()


def test_bench_serve_runs_on_the_cpu(tmp_path, default_model_path):
    out = tmp_path / "bench_serve.json"
    run = subprocess.run([sys.executable, "scripts/bench_serve.py", "--profile", "cpu-default", "--model",
                          default_model_path, "--concurrency", "1,2", "--requests-per-client", "1", "--max-tokens",
                          "4", "--max-prompt-tokens", "48", "--no-warmup", "--timeout", "120", "--load-timeout", "120",
                          "--out", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "aggregate" not in run.stderr and "TTFT p50/p99" in run.stdout
    rows = json.loads(out.read_text())
    assert [r["concurrency"] for r in rows] == [1, 2]
    for r in rows:
        assert set(REQUIRED) <= r.keys()
        assert (r["scenario"], r["gpu"], r["profile"], r["spec"], r["draft_tokens"]) == \
            ("concurrency", "cpu", "cpu-default", "none", 0)
        assert r["errors"] == 0 and r["requests"] == r["concurrency"]
        assert r["completion_tokens"] > 0 and r["aggregate_tok_s"] > 0
        assert r["ttft_p99_s"] >= r["ttft_p50_s"] > 0
        assert r["itl_p99_ms"] >= r["itl_p50_ms"] > 0
        assert r["acceptance"] is None or 0 <= r["acceptance"] <= 1
        assert r["settings"]["held_sequences"] == 0 and r["cached_tokens"] == 0  # no held conversation served one
        assert max(r["workload"]["prompt_tokens"]) <= 48
