"""speedcheck, doctor and gpu-clean: real runs on the CPU, NVML through a fake, processes on a fake device."""
import json
import os
import subprocess
import sys
import time

import psutil
import pytest

from ninfer_tui import profiles
from ninfer_tui.doctor import Finding, gpu_findings
from ninfer_tui.gpu_info import GpuInfo, GpuProcess, NvmlReport
from ninfer_tui.speed_reference import find
from ninfer_tui.speedcheck import spec_advice, verdict

from .conftest import run_cli

SPEED_KEYS = {"model", "profile", "device", "prompt_tokens", "completion_tokens", "prefill_tok_s", "decode_tok_s",
              "ttft_s", "round_ms", "acceptance_rate", "mean_accepted", "peak_gpu_mem_mib", "reference_tok_s",
              "verdict"}


def test_speedcheck_json_on_cpu():
    r = run_cli("speedcheck", "--max-new-tokens", "6", "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert SPEED_KEYS <= set(out)
    assert out["profile"] == "cpu-default" and out["device"] == "cpu" and out["completion_tokens"] == 6
    for key in ("prompt_tokens", "prefill_tok_s", "decode_tok_s", "ttft_s", "round_ms", "reference_tok_s"):
        assert out[key] > 0, key
    assert out["acceptance_rate"] is None and out["mean_accepted"] is None and out["peak_gpu_mem_mib"] is None
    assert out["kv_dtype"] == "int8" and out["prompt_tokens"] > 150
    assert "reference" in out["verdict"] and isinstance(out["doctor"], list)


def test_speedcheck_with_drafts_compares_against_plain_decoding():
    r = run_cli("speedcheck", "--max-new-tokens", "12", "--spec", "ngram", "--draft-tokens", "3", "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["acceptance_rate"] is not None and out["plain_decode_tok_s"] > 0
    assert "with drafts vs" in out["spec_advice"] and "tok/s without" in out["spec_advice"]
    r = run_cli("speedcheck", "--max-new-tokens", "6")  # no drafter: no comparison, no advice
    assert r.returncode == 0 and "with drafts vs" not in r.stdout
    assert [line.split()[-1] for line in r.stdout.splitlines() if line.startswith("decode without drafts")] == ["n/a"]


def test_spec_advice_follows_the_numbers():
    from engine.runtime.request import SpecStats
    from ninfer_tui.profiles import load

    stats = SpecStats(rounds=10, drafted=30, accepted=12)
    profile = load("8k-speed")
    assert "pay." in spec_advice(60.0, 40.0, stats, profile)
    assert "break even" in spec_advice(41.0, 40.0, stats, profile)
    slower = spec_advice(30.0, 40.0, stats, profile)
    assert 'set spec = "none"' in slower and "30.0 tok/s with drafts vs 40.0" in slower and "40%" in slower
    assert spec_advice(30.0, None, None, profile) == ""


def test_speedcheck_plot_and_bad_input():
    r = run_cli("speedcheck", "--max-new-tokens", "8", "--plot")
    assert r.returncode == 0 and "decode tok/s over the run" in r.stdout and "time per round" in r.stdout
    r = run_cli("speedcheck", "--max-new-tokens", "0")
    assert r.returncode == 2 and "--max-new-tokens must be >= 1" in r.stderr


def test_doctor_without_nvml_says_no_gpu():
    r = run_cli("doctor", "--json")
    assert r.returncode == 0, r.stderr
    rows = json.loads(r.stdout)
    gpu = next(x for x in rows if x["check"] == "gpu")
    assert gpu["value"] == "none" and "no GPU visible" in gpu["note"]
    assert {x["check"] for x in rows} >= {"cpu", "host RAM", "versions", "profile", "speculative decoding"}
    assert "Traceback" not in run_cli("doctor").stderr


def _fake_gpu(**kw) -> NvmlReport:
    base = dict(index=0, name="NVIDIA GeForce RTX 4090", mem_total_mib=49140, mem_used_mib=2000, sm_clock_mhz=2520,
                sm_clock_max_mhz=3105, mem_clock_mhz=10501, mem_clock_max_mhz=10501, power_limit_w=450,
                power_default_w=450, temperature_c=60, pcie_gen=4, pcie_gen_max=4, pcie_width=16, pcie_width_max=16)
    return NvmlReport(True, driver="575.57", gpus=[GpuInfo(**{**base, **kw})])


def test_doctor_findings_from_a_fake_nvml():
    healthy = gpu_findings(_fake_gpu())
    assert not [f for f in healthy if f.verdict == "warn"]
    sick = gpu_findings(_fake_gpu(power_limit_w=300, temperature_c=88, throttle_reasons=["software power cap"],
                                  pcie_width=8, processes=[GpuProcess(4242, 1500), GpuProcess(os.getpid(), 100)]),
                        own_pids={os.getpid()})
    warned = {f.check: f for f in sick if f.verdict == "warn"}
    assert set(warned) == {"gpu 0 power limit", "gpu 0 temperature", "gpu 0 throttling", "gpu 0 PCIe",
                           "gpu 0 other processes"}
    assert "4242" in warned["gpu 0 other processes"].value and str(os.getpid()) not in \
        warned["gpu 0 other processes"].value


def test_doctor_says_which_matmuls_the_weights_get():
    """The 8k-speed profile drafts, so its q4/q5 weights want the tiled CUDA matmuls: fine with NVRTC, a warning
    without it; forcing rows under a drafter is a warning too; plain decode on rows is fine."""
    from ninfer_tui.doctor import config_findings, layout_finding

    speed = profiles.load("8k-speed")
    assert layout_finding(speed, "12.8").verdict == "ok" and "NVRTC 12.8" in layout_finding(speed, "12.8").value
    missing = layout_finding(speed, None)
    assert missing.verdict == "warn" and "NVRTC" in missing.note
    rows = layout_finding(profiles.with_overrides(speed, {"weight_layout": "rows"}), "12.8")
    assert rows.verdict == "warn" and "weight_layout" in rows.note
    plain = layout_finding(profiles.with_overrides(speed, {"spec": "none"}), None)
    assert plain.verdict == "ok" and "rows" in plain.value
    assert "weight layout" in {f.check for f in config_findings(speed, gpu=True)}
    assert "weight layout" not in {f.check for f in config_findings(speed, gpu=False)}


def test_doctor_says_how_concurrent_requests_share_the_gpu():
    """multi-user batches 8 lanes; a drafter keeps one lane (turns); a KV pool too small for 8 full-length
    requests says so."""
    from ninfer_tui.doctor import concurrency_finding, config_findings

    multi = profiles.load("multi-user")
    assert concurrency_finding(multi).verdict == "ok" and "8 lanes" in concurrency_finding(multi).value
    drafting = concurrency_finding(profiles.with_overrides(multi, {"spec": "ngram"}))
    assert drafting.verdict == "warn" and "1 lane" in drafting.value and "turns" in drafting.note
    small = concurrency_finding(profiles.with_overrides(multi, {"kv_capacity": 16384}))
    assert small.verdict == "warn" and "8 lanes" in small.value and "holds 2 requests" in small.note
    assert "concurrency" in {f.check for f in config_findings(multi, gpu=True)}
    assert "concurrency" not in {f.check for f in config_findings(profiles.load("8k-speed"), gpu=True)}


def test_verdict_machine_versus_configuration():
    ref = find("NVIDIA GeForce RTX 4090", "8k-speed", "dflash")
    assert ref.decode_tok_s == 213.17 and find("NVIDIA GeForce RTX 4090", "8k-speed", "mtp").decode_tok_s == 147.56
    speed = profiles.load("8k-speed")
    assert "on par" in verdict(205, ref, speed, [])
    hot = [Finding("gpu", "gpu 0 throttling", "hardware thermal slowdown", "warn")]
    assert "The gap is this machine: gpu 0 throttling" in verdict(125, ref, speed, hot)
    slow_cfg = profiles.with_overrides(speed, {"kv_dtype": "bf16"})
    text = verdict(125, ref, slow_cfg, [])
    assert "the gap is the configuration" in text and "kv_dtype: bf16 (reference: int8)" in text
    assert "no row" in verdict(50, None, speed, [])


# ---- gpu-clean on a fake device file ----------------------------------------------------------------------

HOLD = "import sys, time; f = open(sys.argv[1]); time.sleep(120)"


@pytest.fixture
def fake_device(tmp_path):
    dev = tmp_path / "nvidia0"
    dev.write_text("")
    return dev


def _holder(dev, *extra, orphan=False):
    if not orphan:
        return subprocess.Popen([sys.executable, "-c", HOLD, str(dev), *extra])
    # An orphaned "ninfer" process: started through a shell that exits at once.
    script = f'"{sys.executable}" -c "{HOLD}" {dev} ninfer_tui.fake >/dev/null 2>&1 & echo $!'
    out = subprocess.run(["sh", "-c", script], capture_output=True, text=True)
    return psutil.Process(int(out.stdout.strip()))


def _wait_open(pid, dev, timeout=10.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if any(f.path == str(dev) for f in psutil.Process(pid).open_files()):
                return
        except psutil.Error:
            pass
        time.sleep(0.05)
    raise AssertionError("the child never opened the fake device")


def _clean(dev, *args):
    r = run_cli("gpu-clean", "--device-glob", str(dev.parent / "nvidia*"), "--json", *args)
    assert r.returncode == 0, r.stderr
    return {h["pid"]: h for h in json.loads(r.stdout)}


def test_gpu_clean_finds_classifies_and_kills_by_pid(fake_device):
    other = _holder(fake_device)
    orphan = _holder(fake_device, orphan=True)
    me = open(fake_device)  # the test process itself (gpu-clean's parent) holds it too
    try:
        _wait_open(other.pid, fake_device)
        _wait_open(orphan.pid, fake_device)
        seen = _clean(fake_device, "--dry-run")
        assert set(seen) >= {other.pid, orphan.pid, os.getpid()}
        assert seen[other.pid]["ninfer"] is False and seen[other.pid]["action"].startswith("none")
        assert seen[orphan.pid]["ninfer"] is True and seen[orphan.pid]["stale"] is True
        assert seen[orphan.pid]["action"] == "would terminate"
        for key in ("pid", "user", "cmdline", "gpu_mem_mib", "ninfer", "stale", "action"):
            assert key in seen[other.pid]
        assert other.poll() is None and orphan.is_running()  # --dry-run ended nothing

        done = _clean(fake_device, "--yes")  # default: only the stale ninfer process
        assert done[orphan.pid]["action"] == "terminated" and other.poll() is None
        assert not orphan.is_running() or orphan.status() == psutil.STATUS_ZOMBIE

        protected = _clean(fake_device, "--pid", str(os.getpid()), "--yes")
        assert protected[os.getpid()]["action"].startswith("protected")
        done = _clean(fake_device, "--pid", str(other.pid), "--yes")
        assert done[other.pid]["action"] == "terminated"
        assert other.wait(10) is not None
    finally:
        me.close()
        for p in (other,):
            if p.poll() is None:
                p.kill()


def test_gpu_clean_refuses_unknown_pid_and_needs_confirmation(fake_device):
    r = run_cli("gpu-clean", "--device-glob", str(fake_device.parent / "nvidia*"), "--pid", "999999")
    assert r.returncode == 2 and "does not hold the GPU" in r.stderr
    other = _holder(fake_device)
    try:
        _wait_open(other.pid, fake_device)
        r = run_cli("gpu-clean", "--device-glob", str(fake_device.parent / "nvidia*"), "--pid", str(other.pid))
        assert r.returncode == 2 and "--yes" in r.stderr and other.poll() is None  # no terminal, no --yes
    finally:
        other.kill()
