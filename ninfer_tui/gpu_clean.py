"""`ninfer gpu-clean`: find the processes that hold the GPU, show them, and end only the ones named by PID
(by default: stale ninfer processes). Never by name, never itself or its parent chain.

A process counts as ninfer only when it provably is one of ninfer's own: a pidfile in this state dir whose PID,
start time and executable match it, or an interpreter running ninfer's entry point (see
`engine.server.lifecycle.ninfer_args`). It counts as stale only with positive evidence: a listed server that
misses several health checks over several seconds, or a ninfer command (not a server) that was orphaned: its
parent gone, not a session leader of its own (so not started detached on purpose), and run with this state dir.
Everything else is listed and left alone unless the user names its PID."""
from __future__ import annotations

import fnmatch
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import psutil

from engine.server.lifecycle import ServerRecord, answers, end_process, process_ninfer_args, same_start, subcommand

from . import paths
from .gpu_info import NvmlReport

# A process whose parent is one of these was handed to a reaper when its own parent died.
REAPERS = ("systemd", "init")


@dataclass
class Holder:
    pid: int
    user: str
    cmdline: str
    gpu_mem_mib: int | None
    age_s: float
    ninfer: bool
    stale: bool
    why: str  # why it counts as ninfer / stale or not, for the table
    action: str = "none"
    created: float = 0.0  # its create_time, so a PID reused before the signal is never ended

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


def state_dir_of(environ: dict[str, str]) -> Path | None:
    """The state dir a ninfer process with this environment uses (as `paths.state_dir` would compute it there)."""
    if environ.get("NINFER_STATE_DIR"):
        return Path(environ["NINFER_STATE_DIR"])
    base = environ.get("XDG_STATE_HOME") or (environ.get("HOME") and os.path.join(environ["HOME"], ".local/state"))
    return Path(base) / paths.APP if base else None


def _same_dir(a: Path | None, b: Path) -> bool:
    return a is not None and os.path.realpath(a) == os.path.realpath(b)


def orphaned(proc: psutil.Process, state_dir: Path) -> str | None:
    """Why a ninfer command (not a server) counts as orphaned, or None: its parent is gone (it was handed to PID 1
    or a reaper), it is not a session leader (which would mean it was started detached on purpose, e.g. by
    setsid or a service manager), and it runs with this state dir."""
    try:
        ppid = proc.ppid()
        if ppid not in (0, 1):
            try:
                if psutil.Process(ppid).name() not in REAPERS:
                    return None
            except psutil.NoSuchProcess:
                pass
        if os.getsid(proc.pid) == proc.pid:
            return None
        theirs = state_dir_of(proc.environ())
    except (psutil.Error, OSError):
        return None  # no evidence either way
    if not _same_dir(theirs, state_dir):
        return None
    return f"its parent is gone (now {ppid}) and it ran with this state dir ({state_dir})"


def classify(proc: psutil.Process, server: ServerRecord | None, probe, state_dir: Path) -> tuple[bool, bool, str]:
    """(ninfer, stale, why) for one process holding the GPU."""
    if server is not None:
        if probe(server.url):
            return True, False, f"ninfer server {server.url}, answering"
        return True, True, f"ninfer server {server.url} listed in {state_dir}, not answering /health"
    args = process_ninfer_args(proc)
    if args is None:
        return False, False, "not one of ninfer's processes"
    command = subcommand(args)
    if command == "serve":
        return True, False, "ninfer server not listed in this state dir; left alone"
    why = orphaned(proc, state_dir)
    if why:
        return True, True, f"ninfer {command}: {why}"
    return True, False, f"ninfer {command}, not orphaned"


def find_holders(device_glob: str = "/dev/nvidia*", proc_root: Path = Path("/proc"),
                 nvml: NvmlReport | None = None, servers: list[ServerRecord] | None = None, probe=None,
                 state_dir: Path | None = None) -> list[Holder]:
    """Every process holding the GPU, classified. `servers` are the running ninfer servers (validated pidfiles) and
    `probe(url)` answers whether one responds (by default several /health checks over several seconds)."""
    probe = probe or answers
    state_dir = state_dir or paths.state_dir()
    by_pid = {s.pid: s for s in servers or []}
    gpu_mem: dict[int, int | None] = {}
    for g in (nvml.gpus if nvml and nvml.available else []):
        for p in g.processes:
            gpu_mem[p.pid] = (gpu_mem.get(p.pid) or 0) + (p.used_mib or 0) if p.used_mib is not None else None
    pids = holders_of_devices(device_glob, proc_root) | set(gpu_mem)
    out = []
    for pid in sorted(pids - {os.getpid()}):
        try:
            proc = psutil.Process(pid)
            with proc.oneshot():
                cmd, user, created = proc.cmdline(), proc.username(), proc.create_time()
        except psutil.Error:
            continue
        server = by_pid.get(pid)
        if server is not None and not same_start(created, server.started):
            server = None  # the pidfile's server is gone and its PID reused
        ninfer, stale, why = classify(proc, server, probe, state_dir)
        out.append(Holder(pid, user, " ".join(cmd), gpu_mem.get(pid), time.time() - created, ninfer, stale, why,
                          created=created))
    return out


def protected_pids() -> set[int]:
    """This process and its parent chain: never ended, whatever is asked."""
    me = psutil.Process()
    return {me.pid} | {p.pid for p in me.parents()}


def plan_actions(holders: list[Holder], pids: list[int] | None) -> list[Holder]:
    """Mark what would be ended: the named PIDs, or else the stale ninfer processes. Never this process or its
    parent chain."""
    protected = protected_pids()
    for h in holders:
        wanted = h.pid in pids if pids else (h.ninfer and h.stale)
        if h.pid in protected:
            h.action = "protected (this command or its parent chain)" if wanted else "none"
        elif wanted:
            h.action = "terminate"
        else:
            h.action = "none" if pids else "none (not a stale ninfer process; name it with --pid)"
    return holders


def terminate(pid: int, created: float | None = None, timeout: float = 5.0) -> str:
    """SIGTERM, then SIGKILL after `timeout`, to `pid`, if it is still the process listed (same create time)."""
    try:
        proc = psutil.Process(pid)
        if created is not None and not same_start(proc.create_time(), created):
            return "already gone (its PID now belongs to another process)"
        if pid in protected_pids():
            return "protected (this command or its parent chain)"
        return {"ended": "terminated", "killed": "killed (SIGKILL after SIGTERM timed out)",
                "survived": "still running after SIGKILL"}[end_process(proc, timeout)]
    except psutil.NoSuchProcess:
        return "already gone"
    except psutil.AccessDenied:
        return "not permitted (another user's process)"
