"""speedcheck and doctor: real runs on the CPU, NVML through a fake (gpu-clean: test_gpu_clean.py)."""
import json
import os
import subprocess
import sys
import time

from ninfer_tui import profiles
from ninfer_tui.doctor import Finding, gpu_findings
from ninfer_tui.gpu_info import GpuInfo, GpuProcess, NvmlReport
from ninfer_tui.speed_reference import find, matching
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
    r = run_cli("speedcheck", "--max-new-tokens", "12", "--spec", "ngram", "--draft-tokens", "3", "--set",
                "adaptive_drafts=false", "--json")  # every round drafts: its warm-up could time drafts as not paying
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
    none_taken = spec_advice(22.9, 18.8, SpecStats(rounds=10, drafted=30, accepted=0), profile)
    assert "pay." not in none_taken and "No draft was accepted" in none_taken  # 1.22x of noise


def test_speedcheck_plot_and_bad_input():
    r = run_cli("speedcheck", "--max-new-tokens", "8", "--plot")
    assert r.returncode == 0 and "decode tok/s over the run" in r.stdout and "time per round" in r.stdout
    r = run_cli("speedcheck", "--max-new-tokens", "0")
    assert r.returncode == 2 and "--max-new-tokens must be >= 1" in r.stderr


def test_speedcheck_warms_up_on_the_tasks_own_prompt(monkeypatch):
    """The warm-up runs the prompt the check measures (a quarter of it took other kernels, or graphed pieces on a
    GPU, and the measured first token paid the rest's compilation)."""
    from engine import Engine, EngineConfig
    from ninfer_tui import speedcheck

    eng = Engine(EngineConfig("synthetic:tiny", device="cpu", dtype="float32", max_context=8192))
    prompts, submit = [], eng.submit

    def recorded(ids, *args, **kwargs):
        prompts.append(list(ids))
        return submit(ids, *args, **kwargs)

    monkeypatch.setattr(eng, "submit", recorded)  # `complete` submits too
    monkeypatch.setattr(speedcheck, "engine_from_profile", lambda profile, announce=True: eng)
    report = speedcheck.run_speedcheck(profiles.load("cpu-default"), 2, announce=False)
    assert report.completion_tokens == 2 and report.prompt_tokens > 150
    assert len(prompts) == 2 and prompts[0] == prompts[1]  # the warm-up, then the measured run
    assert len(prompts[1]) == report.prompt_tokens


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
    plain = layout_finding(profiles.with_overrides(speed, {"spec": "none", "max_concurrency": 1}), None)
    assert plain.verdict == "ok" and "rows" in plain.value
    assert "weight layout" in {f.check for f in config_findings(speed, gpu=True)}
    assert "weight layout" not in {f.check for f in config_findings(speed, gpu=False)}


def test_doctor_says_how_concurrent_requests_share_the_gpu():
    """multi-user batches 8 lanes; a drafter keeps them (adaptive drafts; fixed ones warn); a KV pool too small
    for 8 full-length requests says so."""
    from ninfer_tui.doctor import concurrency_finding, config_findings

    multi = profiles.load("multi-user")
    assert concurrency_finding(multi).verdict == "ok" and "8 lanes" in concurrency_finding(multi).value
    drafting = concurrency_finding(profiles.with_overrides(multi, {"spec": "ngram"}))
    assert drafting.verdict == "ok" and "8 lanes" in drafting.value and "adaptive_drafts" in drafting.note
    fixed = concurrency_finding(profiles.with_overrides(multi, {"spec": "ngram", "adaptive_drafts": False}))
    assert fixed.verdict == "warn" and "adaptive_drafts = true" in fixed.note
    small = concurrency_finding(profiles.with_overrides(multi, {"kv_capacity": 16384}))
    assert small.verdict == "warn" and "8 lanes" in small.value and "holds 2 requests" in small.note
    assert "concurrency" in {f.check for f in config_findings(multi, gpu=True)}
    speed = {f.check: f for f in config_findings(profiles.load("8k-speed"), gpu=True)}
    assert speed["concurrency"].verdict == "ok" and "2 lanes" in speed["concurrency"].value


def test_verdict_machine_versus_configuration():
    def other(spec: str):
        return next(r for r in matching("NVIDIA GeForce RTX 4090", "8k-speed", spec) if r.kind == "other engine")

    ref = other("dflash")
    assert ref.decode_tok_s == 213.17 and other("mtp").decode_tok_s == 147.56
    speed = profiles.load("8k-speed")
    assert "on par" in verdict(205, ref, speed, [])
    hot = [Finding("gpu", "gpu 0 throttling", "hardware thermal slowdown", "warn")]
    assert "The gap is this machine: gpu 0 throttling" in verdict(125, ref, speed, hot)
    slow_cfg = profiles.with_overrides(speed, {"kv_dtype": "bf16"})
    text = verdict(125, ref, slow_cfg, [])
    assert "the gap is the configuration" in text and "kv_dtype: bf16 (reference: int8)" in text
    assert "no row" in verdict(50, None, speed, [])


# ---- speedcheck's length and Ctrl+C; the doctor's CPU load and RAM speed --------------------------------------

def test_speedcheck_on_a_cpu_runs_the_cpu_references_length():
    from ninfer_tui.speed_reference import task_tokens
    from ninfer_tui.speedcheck import default_tokens

    cpu_ref = find(None, "cpu-default", "none")
    assert default_tokens(profiles.load("cpu-default")) == cpu_ref.new_tokens < 1024
    assert default_tokens(profiles.with_overrides(profiles.load("8k-speed"), {"device": "cpu"})) == cpu_ref.new_tokens
    assert task_tokens("NVIDIA GeForce RTX 4090", "8k-speed", "dflash") == 4096


def test_speedcheck_ctrl_c_prints_the_partial_result():
    """SIGINT after the first tokens: a JSON report marked partial with the tokens so far, exit 130. No
    --max-new-tokens, so it also shows the CPU default length."""
    import signal

    from .conftest import ROOT

    # Ctrl+C as a terminal sends it, also when this run was started in the background (a shell's background jobs
    # ignore SIGINT, and a child inherits that: Python then installs no KeyboardInterrupt handler)
    p = subprocess.Popen([sys.executable, "-m", "ninfer_tui.cli", "speedcheck", "--json"], cwd=ROOT, text=True,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        seen = ""
        while not seen.endswith("%") or "speedcheck [" not in seen:  # the bar's first draw: the first token
            ch = p.stderr.read(1)
            assert ch, f"speedcheck ended before its first token: {seen}"
            seen += ch
        time.sleep(0.5)
        p.send_signal(signal.SIGINT)
        out, err = p.communicate(timeout=60)
    finally:
        if p.poll() is None:
            p.kill()
    assert p.returncode == 130, seen + err
    report = json.loads(out)
    assert report["partial"] is True and report["requested_tokens"] == find(None, "cpu-default", "none").new_tokens
    assert 1 <= report["completion_tokens"] < report["requested_tokens"]
    assert report["ttft_s"] > 0 and report["prefill_tok_s"] > 0
    assert report["verdict"].startswith(f"Interrupted after {report['completion_tokens']} of ")
    assert "Traceback" not in err


def test_doctor_names_the_processes_that_keep_the_cpu_busy():
    from ninfer_tui.doctor import CpuUser, cpu_load_finding, sample_cpu_users

    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(0.3)
        users = sample_cpu_users(interval=1.0)
        mine = [u for u in users if u.pid == busy.pid]
        assert mine and mine[0].percent > 5 and mine[0].name.startswith("python")
        assert os.getpid() not in {u.pid for u in users}  # the doctor never counts itself
        assert busy.pid not in {u.pid for u in sample_cpu_users(interval=0.2, exclude={busy.pid})}
    finally:
        busy.kill()
        busy.wait()
    loaded = cpu_load_finding([CpuUser(4242, "python -m pytest", 97.0), CpuUser(77, "node", 40.0)], 2, 3.1)
    assert loaded.verdict == "warn" and loaded.category == "system"
    assert "1.4 of 2 cores" in loaded.value and "load average 3.1" in loaded.value
    assert "pid 4242 python -m pytest (97%)" in loaded.note and "pid 77 node (40%)" in loaded.note
    assert cpu_load_finding([CpuUser(5, "sshd", 3.0)], 2, 0.2).verdict == "ok"
    assert cpu_load_finding([CpuUser(5, "make", 150.0)], 64, 2.0).verdict == "ok"  # 1.5 of 64 cores


def test_verdict_under_load_names_the_load():
    from ninfer_tui.doctor import CpuUser, cpu_load_finding

    ref = find(None, "cpu-default", "none")
    load = cpu_load_finding([CpuUser(4242, "python -m pytest", 180.0)], 2, 4.0)
    text = verdict(ref.decode_tok_s / 2, ref, profiles.load("cpu-default"), [load])
    assert "The gap is this machine: cpu load: other processes use 1.8 of 2 cores" in text
    assert "pid 4242" in text and "Neither the machine check" not in text


DMIDECODE = """# dmidecode 3.4
Handle 0x0010, DMI type 17, 92 bytes
Memory Device
\tSize: 16 GB
\tSpeed: 3200 MT/s
\tConfigured Memory Speed: 2933 MT/s

Handle 0x0011, DMI type 17, 92 bytes
Memory Device
\tSize: No Module Installed
\tSpeed: Unknown

Handle 0x0012, DMI type 17, 92 bytes
Memory Device
\tSize: 16 GB
\tSpeed: 3200 MT/s
\tConfigured Memory Speed: 2933 MT/s
"""


def _fake_dmidecode(bin_dir, stdout: str, stderr: str = "", code: int = 0):
    bin_dir.mkdir(exist_ok=True)
    tool = bin_dir / "dmidecode"
    tool.write_text(f"#!{sys.executable}\nimport sys\nsys.stdout.write({stdout!r})\nsys.stderr.write({stderr!r})\n"
                    f"sys.exit({code})\n")
    tool.chmod(0o755)


def test_doctor_reads_ram_speed_as_root(tmp_path, monkeypatch):
    """As root the doctor reads the RAM speed (dmidecode), or says why it could not; only without root does it
    say root is needed."""
    from ninfer_tui.doctor import ram_speed_finding

    bin_dir = tmp_path / "bin"
    monkeypatch.setenv("PATH", str(bin_dir))
    assert "without root" in ram_speed_finding(euid=1000).value
    missing = ram_speed_finding(euid=0, root=tmp_path)  # no dmidecode, no SMBIOS table
    assert missing.value == "could not be read" and "no SMBIOS table" in missing.note and "root" not in missing.note
    (tmp_path / "sys/firmware/dmi/tables").mkdir(parents=True)
    assert "dmidecode is not installed" in ram_speed_finding(euid=0, root=tmp_path).note
    _fake_dmidecode(bin_dir, DMIDECODE)
    found = ram_speed_finding(euid=0, root=tmp_path)
    assert found.value == "2 module(s), 3200 MT/s (running at 2933 MT/s)"
    _fake_dmidecode(bin_dir, "Memory Device\n\tSize: 2048 MB\n\tSpeed: Unknown\n")  # a VM's table
    assert "no memory module with a speed" in ram_speed_finding(euid=0, root=tmp_path).note
    _fake_dmidecode(bin_dir, "", "/sys/firmware/dmi/tables/smbios_entry_point: Permission denied", 1)
    failed = ram_speed_finding(euid=0, root=tmp_path)
    assert failed.value == "could not be read" and "Permission denied" in failed.note
    monkeypatch.undo()
    if os.geteuid() == 0:  # the real machine, as root: never "needs root"
        assert "root" not in ram_speed_finding().value
