"""Server processes: pidfiles, readiness, listing and stopping ninfer servers (only ours, only by PID)."""
from __future__ import annotations

import json
import os
import signal
import time
import urllib.error
import urllib.request
from dataclasses import asdict, dataclass
from pathlib import Path

import psutil


@dataclass
class ServerRecord:
    pid: int
    host: str
    port: int
    profile: str
    model: str
    started: float  # the process's create_time, so a reused PID is never mistaken for ours
    log: str = ""

    @property
    def url(self) -> str:
        host = "127.0.0.1" if self.host in ("0.0.0.0", "::", "") else self.host
        return f"http://{host}:{self.port}"


def pidfile(run_dir: Path, pid: int) -> Path:
    return run_dir / f"{pid}.json"


def write_record(run_dir: Path, record: ServerRecord) -> Path:
    run_dir.mkdir(parents=True, exist_ok=True)
    path = pidfile(run_dir, record.pid)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(asdict(record)))
    tmp.replace(path)
    return path


def is_alive(record: ServerRecord) -> bool:
    try:
        proc = psutil.Process(record.pid)
        return abs(proc.create_time() - record.started) < 1.0 and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def list_servers(run_dir: Path) -> list[ServerRecord]:
    """Running servers from their pidfiles; pidfiles of dead processes are removed."""
    out = []
    for path in sorted(run_dir.glob("*.json")) if run_dir.is_dir() else []:
        try:
            record = ServerRecord(**json.loads(path.read_text()))
        except (ValueError, TypeError, OSError):
            path.unlink(missing_ok=True)
            continue
        if is_alive(record):
            out.append(record)
        else:
            path.unlink(missing_ok=True)
    return out


def health(url: str, timeout: float = 1.0) -> dict | None:
    """The /health body, or None when nothing answers."""
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=timeout) as r:
            return json.loads(r.read())
    except urllib.error.HTTPError as exc:  # 503 while loading or after a failed load still has a body
        try:
            return json.loads(exc.read())
        except ValueError:
            return None
    except (OSError, ValueError):
        return None


def stop(record: ServerRecord, timeout: float = 10.0) -> str:
    """SIGTERM, then SIGKILL after `timeout`; returns what happened."""
    if not is_alive(record):
        return "already gone"
    proc = psutil.Process(record.pid)
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout)
        return "stopped"
    except psutil.TimeoutExpired:
        proc.kill()
        proc.wait(5)
        return "killed (did not stop within the timeout)"


def own_record(host: str, port: int, profile: str, model: str, log: str = "") -> ServerRecord:
    pid = os.getpid()
    return ServerRecord(pid, host, port, profile, model, psutil.Process(pid).create_time(), log)


def wait_ready(url: str, proc_alive, timeout: float) -> dict | None:
    """Poll /health until ready, failed, the process died, or the timeout; returns the last health body."""
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline and proc_alive():
        last = health(url, timeout=1.0) or last
        if last and last.get("status") in ("ready", "error"):
            return last
        time.sleep(0.25)
    return last
