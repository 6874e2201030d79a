"""`ninfer doctor` on how the GPUs reach each other: read_nvml against a fake pynvml module, then the findings."""
import sys
import types

import pynvml as real
import pytest

from ninfer_tui.doctor import as_json, gpu_findings, render
from ninfer_tui.gpu_info import GpuLink, read_nvml


def _bus(i: int) -> str:
    return f"00000000:{0x18 + i:02X}:00.0"


SWITCH = "00000000:C0:00.0"


def _fake_nvml(monkeypatch, count: int, links: dict[int, list[str]] | None = None,
               p2p: int = real.NVML_P2P_STATUS_NOT_SUPPORTED, level=lambda a, b: real.NVML_TOPOLOGY_HOSTBRIDGE,
               failing: dict | None = None, absent: frozenset = frozenset()) -> list:
    """A pynvml with `count` GPUs; `links[i]`: the PCI bus id at the far end of each of GPU i's active NVLinks.
    A function it does not define answers NOT_SUPPORTED, as on a driver without it; `failing` maps names to the
    exception they raise, `absent` names that this nvidia-ml-py lacks. Returns the log of topology calls."""
    links = links or {}
    calls = []
    mod = types.ModuleType("pynvml")
    mod.__dict__.update({k: getattr(real, k) for k in dir(real) if k.startswith("NVML_")})
    mod.NVMLError = real.NVMLError

    def link_state(h, n):
        if n >= 18:  # past the card's own links NVML answers INVALID_ARGUMENT, not NOT_SUPPORTED
            raise real.NVMLError(real.NVML_ERROR_INVALID_ARGUMENT)
        return int(n < len(links.get(h, [])))

    def topology(a, b):
        calls.append((a, b))
        return level(a, b)

    mod.__dict__.update(
        nvmlInit=lambda: None, nvmlShutdown=lambda: None, nvmlSystemGetDriverVersion=lambda: "575.57",
        nvmlDeviceGetCount=lambda: count, nvmlDeviceGetHandleByIndex=lambda i: i,
        nvmlDeviceGetName=lambda h: "NVIDIA H100 80GB HBM3",
        nvmlDeviceGetMemoryInfo=lambda h: types.SimpleNamespace(total=80 << 30, used=1 << 30),
        nvmlDeviceGetPciInfo=lambda h: types.SimpleNamespace(busId=_bus(h)),
        nvmlDeviceGetCurrPcieLinkGeneration=lambda h: 4, nvmlDeviceGetCurrPcieLinkWidth=lambda h: 16,
        nvmlDeviceGetNvLinkState=link_state,
        nvmlDeviceGetNvLinkRemotePciInfo=lambda h, n: types.SimpleNamespace(busId=links[h][n]),
        nvmlDeviceGetNvLinkRemoteDeviceType=lambda h, n: real.NVML_NVLINK_DEVICE_TYPE_SWITCH
        if links[h][n] == SWITCH else real.NVML_NVLINK_DEVICE_TYPE_GPU,
        nvmlDeviceGetNvLinkVersion=lambda h, n: real.NVML_NVLINK_VERSION_4_0,
        nvmlDeviceGetFieldValues=lambda h, ids: [types.SimpleNamespace(
            nvmlReturn=real.NVML_SUCCESS, value=types.SimpleNamespace(uiVal=26562))],
        nvmlDeviceGetP2PStatus=lambda a, b, what: p2p if what == real.NVML_P2P_CAPS_INDEX_NVLINK else None,
        nvmlDeviceGetTopologyCommonAncestor=topology,
    )
    for name, exc in (failing or {}).items():
        mod.__dict__[name] = lambda *args, exc=exc: (_ for _ in ()).throw(exc)
    for name in absent:
        del mod.__dict__[name]

    def missing(name):
        if not name.startswith("nvml") or name in absent:
            raise AttributeError(name)
        return lambda *args: (_ for _ in ()).throw(real.NVMLError(real.NVML_ERROR_NOT_SUPPORTED))

    mod.__getattr__ = missing
    monkeypatch.setitem(sys.modules, "pynvml", mod)
    return calls


def _links(findings):
    return [f for f in findings if f.check.startswith("gpu") and f.check.endswith(("link", "links"))]


def test_two_gpus_over_nvlink_are_ok(monkeypatch):
    _fake_nvml(monkeypatch, 2, links={0: [_bus(1)] * 4, 1: [_bus(0)] * 4}, p2p=real.NVML_P2P_STATUS_OK)
    nvml = read_nvml()
    assert nvml.links == [GpuLink((0, 1), True, nvlinks=4, nvlink_version="4.0", nvlink_mbps=26562,
                                  pcie_path=real.NVML_TOPOLOGY_HOSTBRIDGE)]
    findings = gpu_findings(nvml)
    [link] = _links(findings)
    assert (link.check, link.value, link.verdict) == ("gpu 0-1 link", "NVLink 4.0, 4 link(s) of 27 GB/s", "ok")
    assert "gpu 0-1 link" in render(findings)
    assert {"check": "gpu 0-1 link", "category": "gpu", "value": link.value, "verdict": "ok",
            "note": link.note} in as_json(findings)


@pytest.mark.parametrize("level, verdict, hint", [
    (real.NVML_TOPOLOGY_HOSTBRIDGE, "warn", "under one PCIe switch"),
    (real.NVML_TOPOLOGY_SYSTEM, "warn", "on one CPU's slots"),
    (real.NVML_TOPOLOGY_SINGLE, "ok", "without the CPU"),
])
def test_two_gpus_over_pcie_warn_where_the_path_passes_the_cpu(monkeypatch, level, verdict, hint):
    _fake_nvml(monkeypatch, 2, level=lambda a, b: level)
    nvml = read_nvml()
    assert nvml.links == [GpuLink((0, 1), False, pcie_path=level)]
    [link] = _links(gpu_findings(nvml))
    assert link.value.startswith("PCIe ") and ", gen 4 x16 each" in link.value
    assert link.verdict == verdict and hint in link.note and "tensor_parallel" in link.note
    [one_gpu_profile] = _links(gpu_findings(nvml, tensor_parallel=1))  # the link slows nothing down then
    assert one_gpu_profile.verdict == ("info" if verdict == "warn" else verdict)
    assert one_gpu_profile.value == link.value


def test_one_gpu_has_no_link(monkeypatch):
    calls = _fake_nvml(monkeypatch, 1)
    nvml = read_nvml()
    assert len(nvml.gpus) == 1 and nvml.links == [] and calls == []
    assert _links(gpu_findings(nvml)) == []


@pytest.mark.parametrize("how", ["raising", "absent"])
def test_topology_calls_that_fail_leave_the_link_unknown(monkeypatch, how):
    names = ["nvmlDeviceGetPciInfo", "nvmlDeviceGetNvLinkState", "nvmlDeviceGetP2PStatus",
             "nvmlDeviceGetTopologyCommonAncestor"]
    if how == "raising":
        _fake_nvml(monkeypatch, 2, links={0: [_bus(1)], 1: [_bus(0)]},
                   failing={n: real.NVMLError(real.NVML_ERROR_UNKNOWN) for n in names})
    else:
        _fake_nvml(monkeypatch, 2, links={0: [_bus(1)], 1: [_bus(0)]}, absent=frozenset(names))
    nvml = read_nvml()
    assert nvml.links == [GpuLink((0, 1), None)] and nvml.gpus[1].pci_bus_id is None
    [link] = _links(gpu_findings(nvml))
    assert (link.value, link.verdict) == ("unknown", "info") and "nvidia-smi topo -m" in link.note


def test_nvswitch_and_mixed_paths_share_findings(monkeypatch):
    """Links to an NVSwitch reach every GPU on it; pairs that read alike are one finding."""
    _fake_nvml(monkeypatch, 3, links={i: [SWITCH] * 18 for i in range(3)}, p2p=real.NVML_P2P_STATUS_OK)
    [link] = _links(gpu_findings(read_nvml()))
    assert (link.check, link.verdict) == ("gpu links", "ok")
    assert link.value == "all 3 pairs: NVLink 4.0, 18 link(s) of 27 GB/s, through NVSwitch"

    def level(a, b):  # two cards under each of two sockets' switches
        return real.NVML_TOPOLOGY_SINGLE if a // 2 == b // 2 else real.NVML_TOPOLOGY_SYSTEM

    _fake_nvml(monkeypatch, 4, level=level)
    found = {f.verdict: f.value for f in _links(gpu_findings(read_nvml()))}
    assert found["ok"].startswith("0-1, 2-3: PCIe under one PCIe switch (PIX)")
    assert found["warn"].startswith("0-2, 0-3, 1-2, 1-3: PCIe across CPU sockets (SYS)")

    sys.modules["pynvml"].nvmlDeviceGetCurrPcieLinkWidth = lambda h: 16 >> h  # gpu 1 sits in a narrower slot
    assert ", gpu 0 gen 4 x16, gpu 1 gen 4 x8" in _links(gpu_findings(read_nvml()))[0].value
