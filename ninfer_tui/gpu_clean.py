"""`ninfer gpu-clean`: find the processes that hold the GPU, show them, and end only the ones named by PID
(by default: stale ninfer processes). Never by name, never itself or its parent."""
from __future__ import annotations

import fnmatch
import os
import signal
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import psutil

from .gpu_info import NvmlReport


@dataclass
class Holder:
    pid: int
    user: str
    cmdline: str
    gpu_mem_mib: int | None
    age_s: float
    ninfer: bool
    stale: bool
    why: str  # why it counts as ninfer / stale, for the table
    action: str = "none"

    def as_dict(self) -> dict:
        return asdict(self)


def holders_of_devices(device_glob: str, proc_root: Path) -> set[int]:
    """PIDs with an open file descriptor on a path matching `device_glob` (read from <proc_root>/PID/fd)."""
    pids = set()
    for entry in proc_root.iterdir() if proc_root.is_dir() else []:
        if not entry.name.isdigit():
            continue
        try:
            for fd in (entry / "fd").iterdir():
                try:
                    if fnmatch.fnmatch(os.readlink(fd), device_glob):
                        pids.add(int(entry.name))
                        break
                except OSError:
                    continue
        except OSError:  # another user's process, or it just exited
            continue
    return pids


def _is_ninfer(cmd: list[str], server_pids: set[int], pid: int) -> bool:
    if pid in server_pids:
        return True
    joined = " ".join(cmd)
    return any(Path(part).name in ("ninfer", "ninfer-serve") for part in cmd) or "ninfer_tui" in joined


def find_holders(device_glob: str = "/dev/nvidia*", proc_root: Path = Path("/proc"),
                 nvml: NvmlReport | None = None, servers: list | None = None, probe=None) -> list[Holder]:
    """Every process holding the GPU, classified. `servers` are the running ninfer servers (pidfiles) and
    `probe(url)` answers whether one responds; both are parameters so tests can fake them."""
    from engine.server.lifecycle import health

    probe = probe or (lambda url: health(url, timeout=1.0) is not None)
    servers = servers or []
    by_pid = {s.pid: s for s in servers}
    gpu_mem: dict[int, int | None] = {}
    for g in (nvml.gpus if nvml and nvml.available else []):
        for p in g.processes:
            gpu_mem[p.pid] = (gpu_mem.get(p.pid) or 0) + (p.used_mib or 0) if p.used_mib is not None else None
    pids = holders_of_devices(device_glob, proc_root) | set(gpu_mem)
    me = os.getpid()
    out = []
    for pid in sorted(pids - {me}):
        try:
            proc = psutil.Process(pid)
            with proc.oneshot():
                cmd, user, created, ppid = proc.cmdline(), proc.username(), proc.create_time(), proc.ppid()
        except psutil.Error:
            continue
        ninfer = _is_ninfer(cmd, set(by_pid), pid)
        stale, why = False, ""
        if pid in by_pid:
            stale = not probe(by_pid[pid].url)
            why = "ninfer server, not answering" if stale else "ninfer server, answering"
        elif ninfer:
            parent_gone = ppid in (0, 1) or not psutil.pid_exists(ppid)
            stale = parent_gone
            why = "ninfer process, its parent is gone" if stale else "ninfer process, parent alive"
        out.append(Holder(pid, user, " ".join(cmd), gpu_mem.get(pid), time.time() - created, ninfer, stale, why))
    return out


def plan_actions(holders: list[Holder], pids: list[int] | None) -> list[Holder]:
    """Mark what would be ended: the named PIDs, or else the stale ninfer processes. Never this process's parent."""
    parent = os.getppid()
    for h in holders:
        wanted = h.pid in pids if pids else (h.ninfer and h.stale)
        if h.pid == parent:
            h.action = "protected (parent of this command)" if wanted else "none"
        elif wanted:
            h.action = "terminate"
        else:
            h.action = "none" if pids else ("none (not a stale ninfer process; name it with --pid)")
    return holders


def _ended(proc: psutil.Process, timeout: float) -> bool:
    """Whether the process is gone (or a zombie its parent has not reaped yet) within `timeout`."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            if proc.status() == psutil.STATUS_ZOMBIE:
                return True
        except psutil.NoSuchProcess:
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)


def terminate(pid: int, timeout: float = 5.0) -> str:
    try:
        proc = psutil.Process(pid)
        proc.send_signal(signal.SIGTERM)
        if _ended(proc, timeout):
            return "terminated"
        proc.kill()
        return "killed (SIGKILL after SIGTERM timed out)" if _ended(proc, 5.0) else "still running after SIGKILL"
    except psutil.NoSuchProcess:
        return "already gone"
    except psutil.AccessDenied:
        return "not permitted (another user's process)"
