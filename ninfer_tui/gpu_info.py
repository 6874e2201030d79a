"""What NVML says about the GPUs and the processes on them, behind a small interface (tests pass a fake)."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class GpuProcess:
    pid: int
    used_mib: int | None


@dataclass
class GpuInfo:
    index: int
    name: str
    mem_total_mib: int
    mem_used_mib: int
    sm_clock_mhz: int | None = None
    sm_clock_max_mhz: int | None = None
    mem_clock_mhz: int | None = None
    mem_clock_max_mhz: int | None = None
    power_limit_w: float | None = None
    power_default_w: float | None = None
    temperature_c: int | None = None
    throttle_reasons: list[str] = field(default_factory=list)
    pcie_gen: int | None = None
    pcie_gen_max: int | None = None
    pcie_width: int | None = None
    pcie_width_max: int | None = None
    pci_bus_id: str | None = None
    processes: list[GpuProcess] = field(default_factory=list)


# NVML's topology levels (nvmlGpuTopologyLevel_t): the nearest PCIe node two cards share, in nvidia-smi topo's terms
PCIE_PATHS = {0: "on one board", 10: "under one PCIe switch (PIX)", 20: "under several PCIe switches (PXB)",
              30: "through the CPU's host bridge (PHB)", 40: "through the CPU, between its host bridges (NODE)",
              50: "across CPU sockets (SYS)"}
THROUGH_CPU, ACROSS_SOCKETS = 30, 50  # from THROUGH_CPU on, peer-to-peer traffic passes the CPU's root complex


@dataclass
class GpuLink:
    """How two GPUs reach each other; what NVML does not tell stays None."""
    gpus: tuple[int, int]
    nvlink: bool | None = None
    nvlinks: int | None = None  # active NVLinks of the first GPU that lead to the second (directly or via NVSwitch)
    nvswitch: bool = False
    nvlink_version: str | None = None  # "4.0"
    nvlink_mbps: int | None = None  # per link, MB/s
    pcie_path: int | None = None  # a PCIE_PATHS level


@dataclass
class NvmlReport:
    available: bool
    why_not: str = ""
    driver: str | None = None
    gpus: list[GpuInfo] = field(default_factory=list)
    links: list[GpuLink] = field(default_factory=list)  # one per pair of GPUs


# NVML clock-event bits that mean "slower than it could be", by name.
_THROTTLE_BITS = {
    0x2: "applications clocks setting", 0x4: "software power cap", 0x8: "hardware slowdown",
    0x20: "software thermal slowdown", 0x40: "hardware thermal slowdown", 0x80: "hardware power brake",
}


def _safe(fn, *args):
    import pynvml

    try:
        return fn(*args)
    except pynvml.NVMLError:
        return None


def _call(name: str, *args):
    """NVML function `name` through _safe; None also where this nvidia-ml-py lacks it (the package is unpinned)."""
    import pynvml

    fn = getattr(pynvml, name, None)
    return None if fn is None else _safe(fn, *args)


# nvmlDeviceGetNvLinkVersion answers an nvmlNvlinkVersion_t, not the version itself (an A100's 3.1 reads 5)
_NVLINK_VERSIONS = {1: "1.0", 2: "2.0", 3: "2.2", 4: "3.0", 5: "3.1", 6: "4.0", 7: "5.0", 8: "6.0"}


@dataclass
class _NvLinks:
    to: list[str]  # per active link: the PCI bus id at its other end, "switch" for an NVSwitch
    version: str | None = None
    mbps: int | None = None


def _nvlinks(h) -> _NvLinks:
    import pynvml

    active = [n for n in range(pynvml.NVML_NVLINK_MAX_LINKS)
              if _call("nvmlDeviceGetNvLinkState", h, n) == pynvml.NVML_FEATURE_ENABLED]
    if not active:
        return _NvLinks([])
    to = []
    for n in active:
        pci = _call("nvmlDeviceGetNvLinkRemotePciInfo", h, n)
        if _call("nvmlDeviceGetNvLinkRemoteDeviceType", h, n) == pynvml.NVML_NVLINK_DEVICE_TYPE_SWITCH:
            to.append("switch")
        else:
            to.append("?" if pci is None else str(pci.busId).lower())
    values = _call("nvmlDeviceGetFieldValues", h, [pynvml.NVML_FI_DEV_NVLINK_SPEED_MBPS_COMMON])
    mbps = values[0].value.uiVal if values and values[0].nvmlReturn == pynvml.NVML_SUCCESS else None
    return _NvLinks(to, _NVLINK_VERSIONS.get(_call("nvmlDeviceGetNvLinkVersion", h, active[0])), mbps or None)


def read_links(handles: list, gpus: list[GpuInfo]) -> list[GpuLink]:
    """NVLink or the PCIe path between every pair of GPUs. NVLinks to an NVSwitch reach every GPU on it, so
    NVML's peer-to-peer NVLink status decides where no link ends at the other card."""
    import pynvml

    nvlinks = [_nvlinks(h) for h in handles]
    out = []
    for a in range(len(handles)):
        for b in range(a + 1, len(handles)):
            mine, bus = nvlinks[a], gpus[b].pci_bus_id
            p2p = _call("nvmlDeviceGetP2PStatus", handles[a], handles[b], pynvml.NVML_P2P_CAPS_INDEX_NVLINK)
            ok = pynvml.NVML_P2P_STATUS_OK
            direct = mine.to.count(bus) if bus else 0
            switched = mine.to.count("switch") if "switch" in nvlinks[b].to and p2p in (None, ok) else 0
            pair = (gpus[a].index, gpus[b].index)
            if direct or switched or p2p == ok:
                link = GpuLink(pair, True, nvlinks=direct or switched or None, nvswitch=not direct and bool(switched),
                               nvlink_version=mine.version, nvlink_mbps=mine.mbps)
            else:
                link = GpuLink(pair, None if p2p is None else False)
            link.pcie_path = _call("nvmlDeviceGetTopologyCommonAncestor", handles[a], handles[b])
            out.append(link)
    return out


def read_nvml() -> NvmlReport:
    """Everything doctor and gpu-clean need from NVML; `available=False` with the reason when there is none."""
    try:
        import pynvml
    except ImportError:
        return NvmlReport(False, "nvidia-ml-py is not installed")
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as exc:
        return NvmlReport(False, f"no NVIDIA driver or GPU ({exc})")
    try:
        report = NvmlReport(True, driver=_safe(pynvml.nvmlSystemGetDriverVersion))
        handles = []
        for i in range(pynvml.nvmlDeviceGetCount()):
            h = pynvml.nvmlDeviceGetHandleByIndex(i)
            handles.append(h)
            pci = _call("nvmlDeviceGetPciInfo", h)
            mem = pynvml.nvmlDeviceGetMemoryInfo(h)
            power = _safe(pynvml.nvmlDeviceGetEnforcedPowerLimit, h)
            power_default = _safe(pynvml.nvmlDeviceGetPowerManagementDefaultLimit, h)
            reasons = _safe(pynvml.nvmlDeviceGetCurrentClocksThrottleReasons, h) or 0
            procs = _safe(pynvml.nvmlDeviceGetComputeRunningProcesses, h) or []
            report.gpus.append(GpuInfo(
                index=i, name=pynvml.nvmlDeviceGetName(h), mem_total_mib=mem.total >> 20, mem_used_mib=mem.used >> 20,
                sm_clock_mhz=_safe(pynvml.nvmlDeviceGetClockInfo, h, pynvml.NVML_CLOCK_SM),
                sm_clock_max_mhz=_safe(pynvml.nvmlDeviceGetMaxClockInfo, h, pynvml.NVML_CLOCK_SM),
                mem_clock_mhz=_safe(pynvml.nvmlDeviceGetClockInfo, h, pynvml.NVML_CLOCK_MEM),
                mem_clock_max_mhz=_safe(pynvml.nvmlDeviceGetMaxClockInfo, h, pynvml.NVML_CLOCK_MEM),
                power_limit_w=None if power is None else power / 1000,
                power_default_w=None if power_default is None else power_default / 1000,
                temperature_c=_safe(pynvml.nvmlDeviceGetTemperature, h, pynvml.NVML_TEMPERATURE_GPU),
                throttle_reasons=[name for bit, name in _THROTTLE_BITS.items() if reasons & bit],
                pcie_gen=_safe(pynvml.nvmlDeviceGetCurrPcieLinkGeneration, h),
                pcie_gen_max=_safe(pynvml.nvmlDeviceGetMaxPcieLinkGeneration, h),
                pcie_width=_safe(pynvml.nvmlDeviceGetCurrPcieLinkWidth, h),
                pcie_width_max=_safe(pynvml.nvmlDeviceGetMaxPcieLinkWidth, h),
                pci_bus_id=None if pci is None else str(pci.busId).lower(),
                processes=[GpuProcess(p.pid, (p.usedGpuMemory >> 20) if p.usedGpuMemory else None) for p in procs],
            ))
        if len(handles) >= 2:
            report.links = read_links(handles, report.gpus)
        return report
    finally:
        _safe(pynvml.nvmlShutdown)
