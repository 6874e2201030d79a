"""Server processes: pidfiles, readiness, listing and stopping ninfer servers (only ours, only by PID), and
telling ninfer's own processes from everything else (from the interpreter and the entry point it runs, never
from substrings of arguments)."""
from __future__ import annotations

import functools
import importlib.metadata
import ipaddress
import json
import math
import os
import re
import signal
import stat
import sys
import sysconfig
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

import psutil

CONSOLE_SCRIPT = "ninfer"
PIDFILE_MAX_BYTES = 64 * 1024
_PYTHON_EXE = re.compile(r"(python|pypy)\d*(\.\d+)*[a-z]?")
_CREATE_TIME_SLACK_S = 0.1  # create_time is boot time + start ticks: the same process reads the same value


@dataclass
class ServerRecord:
    pid: int
    host: str
    port: int
    profile: str
    model: str
    started: float  # the process's create_time, so a reused PID is never mistaken for ours
    log: str = ""
    exe: str = ""  # the interpreter the server runs in (/proc/PID/exe), checked with the entry point before a signal

    @property
    def url(self) -> str:
        """The URL this machine reaches the server at (loopback for a wildcard bind)."""
        return f"http://{_url_host(local_host(self.host))}:{self.port}"


def local_host(host: str) -> str:
    if host in ("0.0.0.0", ""):
        return "127.0.0.1"
    if host == "::":
        return "::1"
    return host


def _url_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host


def reachable_urls(host: str, port: int) -> list[str]:
    """URLs other machines can use for a server bound to `host`, the most useful first; loopback last. A wildcard
    bind lists this machine's own addresses (what a user would otherwise look up by hand)."""
    if host not in ("0.0.0.0", "::", ""):
        return [f"http://{_url_host(host)}:{port}"]
    found = []
    for addrs in psutil.net_if_addrs().values():
        for a in addrs:
            try:
                ip = ipaddress.ip_address(a.address.split("%")[0])
            except ValueError:
                continue
            if ip.is_loopback or ip.is_link_local or (ip.version == 6 and host != "::"):
                continue
            found.append(ip)
    found.sort(key=lambda ip: ip.version)
    return [f"http://{_url_host(str(ip))}:{port}" for ip in found] + [
        f"http://{_url_host(local_host(host))}:{port}"]


# ---- pidfiles -------------------------------------------------------------------------------------------------

def pidfile(run_dir: Path, pid: int) -> Path:
    return run_dir / f"{pid}.json"


def write_record(run_dir: Path, record: ServerRecord) -> Path:
    """Write the pidfile atomically: a reader sees the whole file or none."""
    run_dir.mkdir(parents=True, exist_ok=True)
    path = pidfile(run_dir, record.pid)
    fd, tmp = tempfile.mkstemp(dir=run_dir, prefix=f".{record.pid}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(asdict(record), f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def own_record(host: str, port: int, profile: str, model: str, log: str = "") -> ServerRecord:
    proc = psutil.Process()
    return ServerRecord(proc.pid, host, port, profile, model, proc.create_time(), log, proc.exe())


def read_record(path: Path) -> ServerRecord:
    """A pidfile, validated. ValueError says what is wrong with it."""
    st = path.lstat()
    if not stat.S_ISREG(st.st_mode):
        raise ValueError("not a regular file")
    if st.st_size > PIDFILE_MAX_BYTES:
        raise ValueError(f"{st.st_size} bytes, more than a pidfile holds")
    try:
        data = json.loads(path.read_bytes().decode("utf-8"))
    except (UnicodeDecodeError, RecursionError) as exc:
        raise ValueError(f"not JSON: {type(exc).__name__}") from None
    except json.JSONDecodeError as exc:
        raise ValueError(f"not JSON: {exc}") from None
    if not isinstance(data, dict):
        raise ValueError("not a JSON object")
    values = {}
    for f in fields(ServerRecord):
        if f.name not in data:
            raise ValueError(f"no {f.name!r}")
        value, kind = data[f.name], {"int": int, "float": (int, float), "str": str}[f.type]
        if not isinstance(value, kind) or isinstance(value, bool):
            raise ValueError(f"{f.name!r} is {type(value).__name__}, not {f.type}")
        values[f.name] = value
    record = ServerRecord(**values)
    if record.pid <= 0 or not 0 < record.port < 65536 or not math.isfinite(record.started) or record.started <= 0:
        raise ValueError("pid, port or start time out of range")
    if path.name != f"{record.pid}.json":
        raise ValueError(f"it names PID {record.pid}")
    return record


@dataclass
class Scan:
    """The pidfiles of a run dir: servers proven to be ours and running, and the files that could not be used
    (path, why), reported and left in place."""

    servers: list[ServerRecord] = field(default_factory=list)
    problems: list[tuple[Path, str]] = field(default_factory=list)


def scan_servers(run_dir: Path) -> Scan:
    """Running servers from their pidfiles. A pidfile whose process is gone (no such PID, or another process
    under a reused PID) is removed; one that cannot be read, or whose process is not a ninfer server, is
    reported and kept."""
    scan = Scan()
    for path in sorted(run_dir.glob("*.json")) if run_dir.is_dir() else []:
        try:
            record = read_record(path)
        except (ValueError, OSError) as exc:
            scan.problems.append((path, f"unreadable pidfile ({exc})"))
            continue
        proc = owner(record)
        if proc is None:
            path.unlink(missing_ok=True)
            continue
        why = not_ours(record, proc)
        if why:
            scan.problems.append((path, why))
        else:
            scan.servers.append(record)
    return scan


def list_servers(run_dir: Path) -> list[ServerRecord]:
    return scan_servers(run_dir).servers


def same_start(created: float, started: float) -> bool:
    """Whether a process created at `created` is the one recorded as started at `started` (not another process
    under a reused PID)."""
    return abs(created - started) <= _CREATE_TIME_SLACK_S


def owner(record: ServerRecord) -> psutil.Process | None:
    """The process that wrote the pidfile, when it still runs (same PID and start time); None only when it is
    provably gone (no such PID, a zombie, or another process under the PID)."""
    try:
        proc = psutil.Process(record.pid)
        if not same_start(proc.create_time(), record.started) or proc.status() == psutil.STATUS_ZOMBIE:
            return None
    except psutil.NoSuchProcess:
        return None
    except psutil.AccessDenied:
        pass  # it exists and cannot be looked at: `not_ours` says so
    return proc


def not_ours(record: ServerRecord, proc: psutil.Process) -> str | None:
    """Why `proc` (the pidfile's PID and start time) cannot be proven to be the ninfer server that wrote it;
    None when it is: the same executable, running ninfer's entry point with the `serve` command."""
    try:
        exe, cmd, cwd = proc.exe(), proc.cmdline(), _cwd(proc)
    except psutil.Error as exc:
        return f"PID {record.pid} cannot be inspected ({type(exc).__name__})"
    if not record.exe or os.path.realpath(exe) != os.path.realpath(record.exe):
        return f"PID {record.pid} runs {exe or 'an unknown executable'}, not the {record.exe or '?'} its pidfile names"
    args = ninfer_args(exe, cmd, cwd)
    if args is None or subcommand(args) != "serve":
        return f"PID {record.pid} is not a ninfer server: {' '.join(cmd)[:120]}"
    return None


# ---- telling ninfer's processes from others ---------------------------------------------------------------------

def _cwd(proc: psutil.Process) -> str | None:
    try:
        return proc.cwd()
    except psutil.Error:
        return None


def is_python(exe: str) -> bool:
    return bool(_PYTHON_EXE.fullmatch(os.path.basename(exe)))


@functools.cache
def entry_modules() -> tuple[str, ...]:
    """The modules `python -m` runs as the `ninfer` command: the console script's own module and its package
    (`-m package` runs its __main__), read from the installed distribution's entry points, so the engine names
    no front-end package; none where the front end is not installed."""
    for ep in importlib.metadata.entry_points(group="console_scripts", name=CONSOLE_SCRIPT):
        return ep.module.split(".")[0], ep.module
    return ()


def console_scripts() -> set[str]:
    """Real paths of this installation's `ninfer` console script (beside its interpreter, or in its scripts dir)."""
    out = set()
    for folder in (Path(sys.executable).parent, Path(sysconfig.get_path("scripts"))):
        path = folder / CONSOLE_SCRIPT
        if path.is_file():
            out.add(os.path.realpath(path))
    return out


def python_target(args: list[str]) -> tuple[str, str, list[str]] | None:
    """What a python command line (its arguments after argv[0]) runs, parsed as the interpreter parses its
    options: ("module", name, rest), ("script", path, rest), ("command", code, rest), or None (stdin, --help)."""
    i = 0
    while i < len(args):
        arg = args[i]
        if arg == "--":
            return ("script", args[i + 1], args[i + 2:]) if i + 1 < len(args) else None
        if arg == "-" or arg.startswith("--") and not arg.startswith("--check-hash-based-pycs"):
            return None  # the program from stdin, or --help / --version
        if arg.startswith("--check-hash-based-pycs"):
            i += 1 if "=" in arg else 2
            continue
        if not arg.startswith("-"):
            return "script", arg, args[i + 1:]
        for j, ch in enumerate(arg[1:], start=1):
            value = arg[j + 1:]
            if ch in "cm":
                if value:
                    return ("command" if ch == "c" else "module"), value, args[i + 1:]
                if i + 1 >= len(args):
                    return None
                return ("command" if ch == "c" else "module"), args[i + 1], args[i + 2:]
            if ch in "WX":
                i += 0 if value else 1  # the option's value is the rest of this argument or the next one
                break
        i += 1
    return None


def ninfer_args(exe: str, cmdline: list[str], cwd: str | None, scripts: set[str] | None = None) -> list[str] | None:
    """The ninfer command-line arguments when a process is an interpreter running ninfer's entry point
    (`python -m` of its entry module or its package, or this installation's `ninfer` console script,
    which the kernel runs as `python /path/to/ninfer ...`); None for any other process, whatever its argv[0]
    or arguments say."""
    if not exe or not is_python(exe) or not cmdline:
        return None
    target = python_target(cmdline[1:])
    if target is None:
        return None
    kind, what, rest = target
    if kind == "module":
        return rest if what in entry_modules() else None
    if kind == "script" and os.path.basename(what) == CONSOLE_SCRIPT:
        path = what if os.path.isabs(what) or cwd is None else os.path.join(cwd, what)
        if os.path.realpath(path) in (console_scripts() if scripts is None else scripts):
            return rest
    return None


def process_ninfer_args(proc: psutil.Process) -> list[str] | None:
    try:
        return ninfer_args(proc.exe(), proc.cmdline(), _cwd(proc))
    except psutil.Error:
        return None


def subcommand(args: list[str]) -> str:
    """The ninfer command a list of ninfer arguments runs ("chat" for bare `ninfer`, which is the app or chat)."""
    i = 0
    while i < len(args):
        arg = args[i]
        if arg in ("--profile", "-P"):
            i += 2
            continue
        if arg == "--":
            break
        if not arg.startswith("-"):
            return arg
        i += 1
    return "chat"


# ---- health, readiness, stopping ----------------------------------------------------------------------------------

def health(url: str, timeout: float = 1.0) -> dict | None:
    """The /health body, or None when nothing answers."""
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=timeout) as r:
            body = json.loads(r.read())
    except urllib.error.HTTPError as exc:  # 503 while loading or after a failed load still has a body
        try:
            body = json.loads(exc.read())
        except ValueError:
            return None
    except (OSError, ValueError):
        return None
    return body if isinstance(body, dict) else None


def answers(url: str, tries: int = 3, interval: float = 2.0, timeout: float = 2.0) -> bool:
    """Whether a server answers /health at least once in `tries` checks `interval` seconds apart: a busy server
    may miss one, a dead or hung one misses them all."""
    for i in range(tries):
        if health(url, timeout) is not None:
            return True
        if i + 1 < tries:
            time.sleep(interval)
    return False


def stop(record: ServerRecord, timeout: float = 10.0) -> str:
    """SIGTERM, then SIGKILL after `timeout`, to the server the pidfile names, once it is proven to be that ninfer
    server; returns what happened. The server removes its own pidfile on SIGTERM; after a SIGKILL the next scan
    does (its owner is gone)."""
    proc = owner(record)
    if proc is None:
        return "already gone"
    why = not_ours(record, proc)
    if why:
        return f"not signalled: {why}"
    try:
        ended = end_process(proc, timeout)  # psutil refuses to signal a PID reused since `owner` looked
    except psutil.NoSuchProcess:
        return "stopped"
    except psutil.AccessDenied:
        return "not permitted (another user's process)"
    return {"ended": "stopped", "killed": "killed (did not stop within the timeout)",
            "survived": "not stopped: still running after SIGKILL"}[ended]


def end_process(proc: psutil.Process, timeout: float) -> str:
    """SIGTERM, then SIGKILL after `timeout`: "ended", "killed" (it took the SIGKILL) or "survived". Raises
    psutil's NoSuchProcess and AccessDenied."""
    proc.send_signal(signal.SIGTERM)
    if _ended(proc, timeout):
        return "ended"
    proc.kill()
    return "killed" if _ended(proc, 5.0) else "survived"


def _ended(proc: psutil.Process, timeout: float) -> bool:
    """Whether the process is gone, or a zombie, within `timeout`. A zombie is reaped by its own parent, not by
    whoever signalled it (`psutil.Process.wait` would wait on it until the timeout)."""
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


def wait_ready(url_of, proc_alive, timeout: float) -> dict | None:
    """Poll /health until ready, failed, the process died, or the timeout; returns the last health body.
    `url_of()` gives the server's URL once it is known (a server on port 0 says so in its pidfile)."""
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline and proc_alive():
        url = url_of()
        last = (health(url, timeout=1.0) if url else None) or last
        if last and last.get("status") in ("ready", "error"):
            return last
        time.sleep(0.25)
    return last
