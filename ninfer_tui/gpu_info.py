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
    processes: list[GpuProcess] = field(default_factory=list)


@dataclass
class NvmlReport:
    available: bool
    why_not: str = ""
    driver: str | None = None
    gpus: list[GpuInfo] = field(default_factory=list)


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
        for i in range(pynvml.nvmlDeviceGetCount()):
            h = pynvml.nvmlDeviceGetHandleByIndex(i)
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
                processes=[GpuProcess(p.pid, (p.usedGpuMemory >> 20) if p.usedGpuMemory else None) for p in procs],
            ))
        return report
    finally:
        _safe(pynvml.nvmlShutdown)
