"""`ninfer doctor`: what decides inference speed on this machine, one finding per line with a verdict."""
from __future__ import annotations

import importlib.metadata
import os
import platform
import re
import shutil
import subprocess
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from .gpu_info import ACROSS_SOCKETS, PCIE_PATHS, THROUGH_CPU, GpuInfo, GpuLink, NvmlReport, read_nvml


@dataclass
class Finding:
    category: str  # "gpu" | "system" | "config"
    check: str
    value: str
    verdict: str  # "ok" | "warn" | "info"
    note: str = ""


def _version(pkg: str) -> str:
    try:
        return importlib.metadata.version(pkg)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def gpu_findings(nvml: NvmlReport, own_pids: set[int] = frozenset(), tensor_parallel: int = 2) -> list[Finding]:
    """`tensor_parallel`: the profile's; a slow link between the GPUs is a cause of low speed only above 1."""
    if not nvml.available:
        return [Finding("gpu", "gpu", "none", "info", f"no GPU visible: {nvml.why_not}; inference runs on the CPU")]
    out = [Finding("gpu", "driver", nvml.driver or "unknown", "info")]
    for g in nvml.gpus:
        tag = f"gpu {g.index}"
        out.append(Finding("gpu", tag, f"{g.name}, {g.mem_total_mib} MiB ({g.mem_used_mib} MiB in use)", "info"))
        if g.sm_clock_mhz is not None and g.sm_clock_max_mhz:
            out.append(Finding("gpu", f"{tag} SM clock", f"{g.sm_clock_mhz} of {g.sm_clock_max_mhz} MHz", "info",
                               "clocks drop when idle; the speed check measures under load"))
        if g.mem_clock_mhz is not None and g.mem_clock_max_mhz:
            low = g.mem_clock_mhz < 0.9 * g.mem_clock_max_mhz and g.sm_clock_mhz and g.sm_clock_max_mhz and \
                g.sm_clock_mhz > 0.8 * g.sm_clock_max_mhz
            out.append(Finding("gpu", f"{tag} memory clock", f"{g.mem_clock_mhz} of {g.mem_clock_max_mhz} MHz",
                               "warn" if low else "info",
                               "memory clock below its maximum under load: decode speed follows it" if low else ""))
        if g.power_limit_w and g.power_default_w:
            capped = g.power_limit_w < 0.95 * g.power_default_w
            limit = f"{g.power_limit_w:.0f} W (default {g.power_default_w:.0f} W)"
            out.append(Finding("gpu", f"{tag} power limit", limit, "warn" if capped else "ok",
                               "power-capped below the default: restore it with `nvidia-smi -pl`" if capped else ""))
        if g.temperature_c is not None:
            hot = g.temperature_c >= 83
            out.append(Finding("gpu", f"{tag} temperature", f"{g.temperature_c} C", "warn" if hot else "ok",
                               "hot enough to throttle: check cooling" if hot else ""))
        out.append(Finding("gpu", f"{tag} throttling", ", ".join(g.throttle_reasons) or "none",
                           "warn" if g.throttle_reasons else "ok"))
        if g.pcie_width and g.pcie_width_max:
            narrow = g.pcie_width < g.pcie_width_max
            out.append(Finding("gpu", f"{tag} PCIe", f"gen {g.pcie_gen} of {g.pcie_gen_max}, x{g.pcie_width} of "
                               f"x{g.pcie_width_max}", "warn" if narrow else "info",
                               "the link runs narrower than the card supports (slot or riser)" if narrow else
                               "the generation drops when idle"))
        others = [p for p in g.processes if p.pid not in own_pids]
        if others:
            desc = ", ".join(f"pid {p.pid} ({p.used_mib if p.used_mib is not None else '?'} MiB)" for p in others)
            out.append(Finding("gpu", f"{tag} other processes", desc, "warn",
                               "they share the GPU's memory bandwidth; see `ninfer gpu-clean`"))
        else:
            out.append(Finding("gpu", f"{tag} other processes", "none", "ok"))
    return out + link_findings(nvml, tensor_parallel)


def _describe_link(link: GpuLink, gpus: dict[int, GpuInfo]) -> tuple[str, str, str]:
    """A link's value, verdict and note."""
    if link.nvlink:
        parts = [f"NVLink {link.nvlink_version}" if link.nvlink_version else "NVLink"]
        if link.nvlinks:
            parts.append(f"{link.nvlinks} link(s)" + (f" of {link.nvlink_mbps / 1000:.0f} GB/s" if link.nvlink_mbps
                                                      else ""))
        if link.nvswitch:
            parts.append("through NVSwitch")
        return ", ".join(parts), "ok", "tensor_parallel's all-reduces run over NVLink"
    if link.pcie_path is None:
        return ("unknown" if link.nvlink is None else "PCIe, path unknown"), "info", \
            "NVML does not say how these cards connect: `nvidia-smi topo -m` shows it"
    ends = {i: f"gen {g.pcie_gen} x{g.pcie_width}" for i in link.gpus
            if (g := gpus.get(i)) and g.pcie_gen and g.pcie_width}
    # alike ends are said once, so that pairs of alike cards share a finding
    cards = f"{ends[link.gpus[0]]} each" if len(ends) == 2 and len(set(ends.values())) == 1 else \
        ", ".join(f"gpu {i} {e}" for i, e in ends.items())
    value = f"PCIe {PCIE_PATHS.get(link.pcie_path, f'topology level {link.pcie_path}')}" + \
        (f", {cards}" if cards else "") + ("; NVLink unknown" if link.nvlink is None else "")
    if link.pcie_path < THROUGH_CPU:
        return value, "ok", "peer to peer without the CPU; NVLink would speed up tensor_parallel's all-reduces"
    fix = "put both cards on one CPU's slots, ideally under one PCIe switch," if link.pcie_path >= ACROSS_SOCKETS else \
        "put the cards in slots under one PCIe switch"
    return value, "warn", ("tensor_parallel all-reduces after every layer and this path passes the CPU: expect "
                           f"lower tensor-parallel scaling; {fix} or bridge them with NVLink")


def link_findings(nvml: NvmlReport, tensor_parallel: int = 2) -> list[Finding]:
    """How the GPUs reach each other, with two or more; pairs that read alike share one finding. A path through
    the CPU is a warning only for a profile that splits the model over the GPUs (the speed check lists warnings
    as causes)."""
    if len(nvml.gpus) < 2:
        return []
    gpus = {g.index: g for g in nvml.gpus}
    groups: dict[tuple[str, str, str], list[str]] = {}
    for link in nvml.links:
        value, verdict, note = _describe_link(link, gpus)
        if verdict == "warn" and tensor_parallel < 2:
            verdict, note = "info", f"no effect with tensor_parallel = {tensor_parallel}; above 1: {note}"
        groups.setdefault((value, verdict, note), []).append(f"{link.gpus[0]}-{link.gpus[1]}")
    out = []
    for (value, verdict, note), pairs in groups.items():
        if len(pairs) == 1:
            out.append(Finding("gpu", f"gpu {pairs[0]} link", value, verdict, note))
        else:
            which = f"all {len(pairs)} pairs" if len(pairs) == len(nvml.links) else ", ".join(pairs)
            out.append(Finding("gpu", "gpu links", f"{which}: {value}", verdict, note))
    return out


def _dmidecode_speeds(text: str) -> str | None:
    """The installed modules' rated and configured speeds from `dmidecode -t memory`, or None if it lists none."""
    rated, running, count = set(), set(), 0
    for block in text.split("Memory Device")[1:]:
        fields = dict(re.findall(r"^\s*([A-Za-z ]+):\s*(.+?)\s*$", block, re.M))
        if fields.get("Size", "No Module Installed").startswith(("No Module", "Not Installed")):
            continue
        count += 1
        speed = fields.get("Speed", "Unknown")
        conf = fields.get("Configured Memory Speed", fields.get("Configured Clock Speed", "Unknown"))
        if speed != "Unknown":
            rated.add(speed)
        if conf not in ("Unknown", speed):
            running.add(conf)
    if not rated and not running:
        return None
    text = f"{count} module(s), {', '.join(sorted(rated)) or 'rated speed unknown'}"
    return text + (f" (running at {', '.join(sorted(running))})" if running else "")


def ram_speed_finding(euid: int | None = None, root: Path = Path("/")) -> Finding:
    """The RAM's speed from the SMBIOS table through dmidecode, which needs root; as root it is read, or the
    reason it cannot be is given."""
    euid = os.geteuid() if euid is None else euid
    if euid != 0:
        return Finding("system", "host RAM speed", "not readable without root", "info",
                       "run `sudo dmidecode -t memory` (or the doctor as root) to see it")
    tool = shutil.which("dmidecode")
    if tool is None:
        if not (root / "sys/firmware/dmi/tables").exists():
            return Finding("system", "host RAM speed", "could not be read", "info", "no SMBIOS table is visible "
                           "here (a container or VM) and dmidecode is not installed: run `dmidecode -t memory` on "
                           "the host")
        return Finding("system", "host RAM speed", "could not be read", "info",
                       "dmidecode is not installed: install it (e.g. apt install dmidecode) and run the doctor again")
    try:
        r = subprocess.run([tool, "-t", "memory"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return Finding("system", "host RAM speed", "could not be read", "info", f"dmidecode failed: {exc}")
    if r.returncode != 0:  # e.g. no SMBIOS entry point, or /sys/firmware/dmi not readable
        said = (r.stderr.strip() or r.stdout.strip()).splitlines()
        why = said[-1].lstrip("# ") if said else f"it exited {r.returncode}"
        return Finding("system", "host RAM speed", "could not be read", "info", f"dmidecode: {why}")
    speeds = _dmidecode_speeds(r.stdout)
    if speeds is None:
        return Finding("system", "host RAM speed", "could not be read", "info",
                       "dmidecode lists no memory module with a speed (common in VMs)")
    return Finding("system", "host RAM speed", speeds, "info", "from dmidecode -t memory")


@dataclass(frozen=True)
class CpuUser:
    pid: int
    name: str  # the process name, with its first arguments for interpreters
    percent: float  # of one core


_INTERPRETERS = ("python", "node", "java", "ruby", "perl", "sh", "bash")


def _label(name: str, cmdline: list[str]) -> str:
    """A process's name; for an interpreter its first arguments too ("python -m pytest"), on one short line."""
    if not cmdline or not Path(cmdline[0]).name.startswith(_INTERPRETERS):
        return name
    text = " ".join(" ".join([Path(cmdline[0]).name, *cmdline[1:3]]).split())
    return text if len(text) <= 40 else text[:39] + "…"


def sample_cpu_users(interval: float = 0.5, exclude: set[int] = frozenset()) -> list[CpuUser]:
    """Every other process's CPU use over `interval` seconds, busiest first (this process and `exclude` left out)."""
    import psutil

    skip = {os.getpid(), *exclude}
    procs = []
    for p in psutil.process_iter(["pid"]):
        if p.pid in skip:
            continue
        try:
            p.cpu_percent(None)  # the first call starts the process's measurement
            procs.append(p)
        except psutil.Error:
            continue
    time.sleep(interval)
    out = []
    for p in procs:
        try:
            with p.oneshot():
                pct, name, cmd = p.cpu_percent(None), p.name(), p.cmdline()
        except psutil.Error:
            continue
        if pct > 0:
            out.append(CpuUser(p.pid, _label(name, cmd), pct))
    return sorted(out, key=lambda u: -u.percent)


def cpu_load_finding(users: list[CpuUser], cores: int, load_avg: float) -> Finding:
    """Whether other processes take CPU time inference needs: a CPU engine's matmuls and a GPU engine's host side
    (launches, sampling) both run on these cores. A warning from half a core (or a quarter of the cores) busy."""
    busy = sum(u.percent for u in users) / 100
    value = f"other processes use {busy:.1f} of {cores} cores (load average {load_avg:.1f})"
    top = ", ".join(f"pid {u.pid} {u.name} ({u.percent:.0f}%)" for u in users[:3])
    if busy >= max(0.5, cores / 4):
        return Finding("system", "cpu load", value, "warn",
                       f"busiest: {top}; inference gets the CPU time they leave, so expect lower speed until "
                       "they finish")
    return Finding("system", "cpu load", value, "ok", f"busiest: {top}" if top else "")


def system_findings(root: Path = Path("/"), own_pids: set[int] = frozenset()) -> list[Finding]:
    import psutil

    out = []
    cpu = platform.processor() or "unknown"
    cpuinfo = root / "proc/cpuinfo"
    if cpuinfo.is_file():
        for line in cpuinfo.read_text(errors="replace").splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    out.append(Finding("system", "cpu", f"{cpu}, {os.cpu_count()} logical cores", "info"))
    gov = root / "sys/devices/system/cpu/cpu0/cpufreq/scaling_governor"
    if gov.is_file():
        g = gov.read_text().strip()
        out.append(Finding("system", "cpu governor", g, "warn" if g == "powersave" else "ok",
                           "powersave slows the host side of every step; use performance" if g == "powersave" else ""))
    else:
        out.append(Finding("system", "cpu governor", "not readable", "info"))
    out.append(cpu_load_finding(sample_cpu_users(exclude=own_pids), os.cpu_count() or 1, os.getloadavg()[0]))
    vm = psutil.virtual_memory()
    out.append(Finding("system", "host RAM", f"{vm.total >> 30} GiB ({vm.available >> 30} GiB available)", "info"))
    out.append(ram_speed_finding(root=root))
    try:
        import torch

        cuda = torch.version.cuda or "none (CPU build)"
    except ImportError:
        cuda = "torch not installed"
    out.append(Finding("system", "versions", f"python {platform.python_version()}, torch {_version('torch')}, "
                       f"CUDA {cuda}, triton {_version('triton')}, ninfer {_version('ninfer')}", "info"))
    return out


def config_findings(profile, gpu: bool) -> list[Finding]:
    out = [Finding("config", "profile", f"{profile.name} (model {profile.model})", "info")]
    out.append(Finding("config", "context", f"max_context {profile.max_context}, kv_dtype {profile.kv_dtype}",
                       "warn" if gpu and profile.kv_dtype == "bf16" else "ok",
                       "bf16 KV reads twice the bytes of int8/fp8 per step" if gpu and profile.kv_dtype == "bf16"
                       else ""))
    spec = f"{profile.spec}" + (f", draft_tokens {profile.draft_tokens}" if profile.spec != "none" else "")
    out.append(Finding("config", "speculative decoding", spec, "warn" if gpu and profile.spec == "none" else "ok",
                       "without drafts each step yields one token; the reference numbers use K=7 drafts"
                       if gpu and profile.spec == "none" else ""))
    if gpu:
        out.append(Finding("config", "cuda graphs", str(profile.cuda_graphs).lower(),
                           "ok" if profile.cuda_graphs else "warn",
                           "" if profile.cuda_graphs else "without graphs the host launches every kernel"))
    quant = profile.weights.quantized()
    out.append(Finding("config", "weights", ", ".join(f"{k} {v}" for k, v in profile.weights.as_dict().items()),
                       "warn" if gpu and not quant else "ok",
                       "unquantized weights: each step reads ~3x the bytes of q4/q5" if gpu and not quant else ""))
    if gpu and profile.max_concurrency > 1:
        out.append(concurrency_finding(profile))
    if gpu and {"q4", "q5"} & set(profile.weights.as_dict().values()):
        from engine import nvrtc

        out.append(layout_finding(profile, nvrtc.version()))
    return out


# what row-major q4/q5 weights cost per 8-row matmul against tiled ones (the measurements: docs/kernels.md)
_ROWS_COST = "1.06-1.35x the time per 8-row matmul of tiled ones on an H200"


def concurrency_finding(profile) -> Finding:
    """How requests that run at once share the GPU: with CUDA graphs, one lane (a working cache) each; plain
    decode steps batched in one graph, verify steps of drafting requests one lane's graph after another; the KV
    pool's blocks go to the running requests (prompt + max_tokens each), so a pool smaller than max_concurrency
    full-length requests may make some wait."""
    config = profile.engine_config(profile.model)
    value = f"max_concurrency {profile.max_concurrency}"
    if not profile.cuda_graphs:
        return Finding("config", "concurrency", value, "ok", "the running requests' rows run as one step (eager)")
    lanes = config.graph_lanes
    full = config.kv_tokens // profile.max_context
    if full < profile.max_concurrency:
        return Finding("config", "concurrency", f"{value}, {lanes} lanes", "warn",
                       f"the KV pool ({config.kv_tokens} tokens) holds {full} requests of max_context "
                       f"{profile.max_context} at once; shorter ones share it (each takes prompt + max_tokens), "
                       "others wait for blocks: raise kv_capacity or lower max_context")
    if profile.spec != "none" and not profile.adaptive_drafts:
        return Finding("config", "concurrency", f"{value}, {lanes} lanes", "warn",
                       "every round verifies draft_tokens drafts, and verify steps replay one lane's graph after "
                       "another: with several requests running, plain batched steps may make more tokens per "
                       "second; set adaptive_drafts = true")
    if profile.spec != "none":
        return Finding("config", "concurrency", f"{value}, {lanes} lanes", "ok",
                       "each request drafts in its lane; steps draft where that made more tokens per second at the "
                       "current load, else run as one batched plain step (adaptive_drafts)")
    return Finding("config", "concurrency", f"{value}, {lanes} lanes", "ok",
                   "decode steps of running requests batched in CUDA graphs")


def layout_finding(profile, found: str | None) -> Finding:
    """Which matmuls the q4/q5 weights get: tiled ones (CUDA, compiled by NVRTC `found`, None when absent) serve
    steps of several rows faster, row-major ones (Triton) one-token steps."""
    tiled = profile.engine_config(profile.model).tiled_weights
    several = "verify steps" if profile.spec != "none" else "batched steps"
    if tiled and found is None:
        return Finding("config", "weight layout", f"{profile.weight_layout}: tiles wanted, no NVRTC", "warn",
                       f"the tiled CUDA matmuls compile with NVRTC, which this torch build lacks: {several} run "
                       f"the row-major Triton ones ({_ROWS_COST}); install torch's CUDA build")
    if tiled:
        return Finding("config", "weight layout", f"{profile.weight_layout}: tiles (CUDA matmuls, NVRTC {found})",
                       "ok")
    if profile.spec != "none":
        return Finding("config", "weight layout", f"{profile.weight_layout}: rows (Triton matmuls)", "warn",
                       f"verify steps on row-major weights take {_ROWS_COST}: set weight_layout = \"auto\"")
    return Finding("config", "weight layout", f"{profile.weight_layout}: rows (Triton matmuls)", "ok",
                   "one-token steps: the row-major kernels are the faster ones")


def diagnose(profile, nvml: NvmlReport | None = None, own_pids: set[int] = frozenset()) -> list[Finding]:
    nvml = read_nvml() if nvml is None else nvml
    on_gpu = nvml.available and profile.device != "cpu"
    return gpu_findings(nvml, own_pids, profile.tensor_parallel) + system_findings(own_pids=own_pids) + \
        config_findings(profile, on_gpu)


def as_json(findings: list[Finding]) -> list[dict]:
    return [asdict(f) for f in findings]


def render(findings: list[Finding]) -> str:
    marks = {"ok": "ok  ", "warn": "WARN", "info": "    "}
    lines = []
    for f in findings:
        line = f"[{marks[f.verdict]}] {f.check:24s} {f.value}"
        if f.note:
            line += f"  -- {f.note}"
        lines.append(line)
    return "\n".join(lines)
