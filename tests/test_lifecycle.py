"""Server processes: `serve --detach` (its terminal output, its failures), pidfiles (atomic, validated, removed on
SIGTERM), `ninfer ps` and `ninfer stop` (only a process proven to be the ninfer server its pidfile names).
One real detached server for the module, stopped by the last test; every other process a test starts is ended
by that test, by PID."""
import glob
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from engine.server.lifecycle import ServerRecord, pidfile, reachable_urls, read_record, scan_servers, write_record

from .conftest import run_cli
from .server_util import free_port

MODEL = "smollm2-135m"
KEY = "lifecycle-key"
# A KV pool no machine has the memory for: the engine refuses it at load, after the server is up.
NEVER_FITS = ("--kv-capacity", "16777216", "--max-context", "131072")


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    base = tmp_path_factory.mktemp("lifecycle")
    return {**os.environ, **{v: str(base / v.lower()) for v in ("NINFER_CONFIG_DIR", "NINFER_DATA_DIR",
                                                                 "NINFER_STATE_DIR")}}


def servers_dir(env) -> Path:
    return Path(env["NINFER_STATE_DIR"]) / "servers"


@pytest.fixture(scope="module")
def detached(env):
    """`ninfer serve --detach` on every address (with a key), as a user would start it."""
    port = free_port()
    r = run_cli("serve", "--detach", "--host", "0.0.0.0", "--api-key", KEY, "--port", str(port), env=env)
    started = re.search(r"starting ninfer server \(pid (\d+)", r.stderr)
    proc = psutil.Process(int(started.group(1))) if started else None
    try:
        assert r.returncode == 0, r.stderr
        yield proc.pid, port, r
    finally:
        if proc is not None and proc.is_running():  # the last test stops it; this is for a failed run
            proc.kill()


def test_detach_prints_the_reachable_url_in_the_terminal(env, detached):
    pid, port, r = detached
    urls = reachable_urls("0.0.0.0", port)
    assert f"ready: {urls[0]} (pid {pid}, profile cpu-default, model {MODEL}" in r.stdout
    if len(urls) > 1:  # a machine with a network address: that first, loopback after
        assert "127.0.0.1" not in urls[0] and f"; also at {', '.join(urls[1:])})" in r.stdout
    assert urls[-1] == f"http://127.0.0.1:{port}"
    assert "without an API key" not in r.stderr
    rows = json.loads(run_cli("ps", "--json", env=env).stdout)
    row = next(x for x in rows if x["pid"] == pid)
    assert row["status"] == "ready" and row["port"] == port and row["url"] == f"http://127.0.0.1:{port}"
    assert row["log"].endswith(f"serve-{port}.log")


def test_detach_without_a_key_warns_in_the_terminal(env):
    # The server fails its checks before it binds (a drafter-less dflash), so nothing is ever exposed.
    r = run_cli("serve", "--detach", "--host", "0.0.0.0", "--port", str(free_port()), "--spec", "dflash", env=env)
    assert "warning: listening on 0.0.0.0 without an API key" in r.stderr
    assert r.returncode == 2 and 'spec = "dflash" needs a drafter checkpoint' in r.stderr, r.stderr


def test_detach_bad_input_exits_2_before_starting_anything(env):
    r = run_cli("serve", "--detach", "--port", str(free_port()), "--model", "/no/such/model.gguf", env=env)
    assert r.returncode == 2 and "neither a known model name nor an existing path" in r.stderr
    assert "starting ninfer server" not in r.stderr and "did not start" not in r.stderr
    if not glob.glob("/dev/nvidia[0-9]*"):  # no GPU here: --device cuda is bad input
        r = run_cli("serve", "--detach", "--port", str(free_port()), "--device", "cuda", env=env)
        assert r.returncode == 2 and "no CUDA GPU" in r.stderr and "starting ninfer server" not in r.stderr


def test_detach_load_failure_reports_this_runs_own_error(env):
    port = free_port()
    log = Path(env["NINFER_STATE_DIR"]) / "logs" / f"serve-{port}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    log.write_text("error: a line of an earlier run\n")
    before = set(servers_dir(env).glob("*.json"))
    r = run_cli("serve", "--detach", "--port", str(port), *NEVER_FITS, env=env)
    assert r.returncode == 2, r.stderr
    assert "starting ninfer server" in r.stderr and "do not fit in memory" in r.stderr and "hint:" in r.stderr
    assert "earlier run" not in r.stderr and "did not start: it exited" not in r.stderr
    assert set(servers_dir(env).glob("*.json")) == before  # the failed server took its pidfile with it
    assert "earlier run" in log.read_text()  # the log is appended to, never cut


def test_malformed_pidfiles_are_reported_and_skipped(env, detached, tmp_path):
    pid = detached[0]
    d = servers_dir(env)
    bad = [b"{not json", b"", b"[1, 2]", b"[" * 30_000 + b"]" * 30_000, b" " * 70_000, b"\xff\xfe\x00",
           json.dumps({"pid": "1", "host": 1}).encode(), json.dumps({"pid": 7}).encode()]
    paths = []
    for i, content in enumerate(bad):
        path = d / f"{900000 + i}.json"
        path.write_bytes(content)
        paths.append(path)
    renamed = d / "900100.json"  # a good record under another PID's name
    renamed.write_text(json.dumps({**json.loads(pidfile(d, pid).read_text())}))
    fifo, folder = d / "900101.json", d / "900102.json"
    os.mkfifo(fifo)  # reading it would block `ninfer ps` forever
    folder.mkdir()
    paths += [renamed, fifo, folder]
    try:
        r = run_cli("ps", "--json", env=env, timeout=60)
        assert r.returncode == 0, r.stderr
        assert [x["pid"] for x in json.loads(r.stdout)] == [pid]
        for path in paths:
            assert f"warning: skipped {path}: unreadable pidfile" in r.stderr, path
            assert path.exists()  # reported, never silently deleted
        r = run_cli("ps", env=env, timeout=60)
        assert r.returncode == 0 and str(pid) in r.stdout
        r = run_cli("stop", "900100", env=env)
        assert r.returncode == 2 and "it names PID" in r.stderr and psutil.pid_exists(pid)
    finally:
        for path in paths:
            path.rmdir() if path.is_dir() else path.unlink()


def test_read_record_validates_every_field(tmp_path):
    record = ServerRecord(123, "127.0.0.1", 8080, "p", "m", 1.5e9, "", sys.executable)
    path = write_record(tmp_path, record)
    assert read_record(path) == record and not list(tmp_path.glob("*.tmp"))  # no temporary file left
    for change, why in [({"port": 0}, "out of range"), ({"port": True}, "'port' is bool"),
                        ({"started": float("nan")}, "out of range"), ({"pid": -1}, "out of range"),
                        ({"exe": None}, "'exe' is NoneType")]:
        path.write_text(json.dumps({**record.__dict__, **change}))
        with pytest.raises(ValueError, match=why):
            read_record(path)


def test_a_pidfile_whose_process_is_gone_is_removed(tmp_path):
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    path = write_record(tmp_path, ServerRecord(proc.pid, "127.0.0.1", 1, "p", "m", time.time() - 60, "",
                                               sys.executable))
    scan = scan_servers(tmp_path)
    assert scan.servers == [] and scan.problems == [] and not path.exists()


# Starts the command in its arguments and never waits for it: what it starts stays a zombie once it ends.
NO_REAP = ("import subprocess, sys, time\np = subprocess.Popen(sys.argv[1:])\nprint(p.pid, flush=True)\n"
           "time.sleep(120)\n")


def test_stop_does_not_wait_on_a_server_its_parent_never_reaps(tmp_path):
    """A server under a parent that never reaps it (a supervisor that does not wait) is a zombie once it has
    ended: `stop` says so at once instead of waiting out the timeout and the SIGKILL's on it and failing. The
    server is ninfer's entry point run from a stand-in package (its command line is ninfer's own)."""
    from engine.server.lifecycle import stop

    (tmp_path / "ninfer_tui").mkdir()
    (tmp_path / "ninfer_tui" / "__init__.py").write_text("")
    (tmp_path / "ninfer_tui" / "cli.py").write_text("import time\ntime.sleep(120)\n")
    parent = subprocess.Popen([sys.executable, "-c", NO_REAP, sys.executable, "-m", "ninfer_tui.cli", "serve"],
                              stdout=subprocess.PIPE, text=True, cwd=tmp_path,
                              env={**os.environ, "PYTHONPATH": str(tmp_path)})
    try:
        server = psutil.Process(int(parent.stdout.readline()))
        deadline = time.monotonic() + 10
        while "ninfer_tui.cli" not in server.cmdline() and time.monotonic() < deadline:
            time.sleep(0.01)  # the child may not have exec'd its command line yet
        record = ServerRecord(server.pid, "127.0.0.1", 1, "p", "m", server.create_time(), "", server.exe())
        t0 = time.monotonic()
        assert stop(record, timeout=3) == "stopped"
        assert time.monotonic() - t0 < 3 and server.status() == psutil.STATUS_ZOMBIE
    finally:
        parent.kill()  # its zombie child goes to init, which reaps it
        parent.wait()
        parent.stdout.close()


def test_stop_signals_only_a_process_proven_to_be_the_ninfer_server(env, detached, tmp_path):
    """A pidfile whose PID and start time match a live process that is not ninfer's server (here: a plain python
    process, and the same under a pidfile naming another executable): `ps` skips it, `stop` refuses it."""
    d = servers_dir(env)
    decoy = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    try:
        p = psutil.Process(decoy.pid)
        path = write_record(d, ServerRecord(decoy.pid, "127.0.0.1", 1, "x", "x", p.create_time(), "", p.exe()))
        r = run_cli("ps", "--json", env=env)
        assert decoy.pid not in [x["pid"] for x in json.loads(r.stdout)]
        assert f"skipped {path}: PID {decoy.pid} is not a ninfer server" in r.stderr
        r = run_cli("stop", str(decoy.pid), env=env)
        assert r.returncode == 2 and "is not a ninfer server" in r.stderr
        assert decoy.poll() is None and path.exists()
        server = read_record(pidfile(d, detached[0]))
        liar = ServerRecord(**{**server.__dict__, "exe": "/usr/bin/env"})
        from engine.server.lifecycle import stop

        assert stop(liar).startswith("not signalled") and psutil.pid_exists(server.pid)
    finally:
        decoy.kill()
        decoy.wait()
        pidfile(d, decoy.pid).unlink(missing_ok=True)


def test_stop_all_ends_the_server_which_removes_its_own_pidfile(env, detached):
    pid = detached[0]
    path = pidfile(servers_dir(env), pid)
    assert path.exists()
    r = run_cli("stop", "--all", env=env)
    assert r.returncode == 0 and f"{pid} (http://127.0.0.1:{detached[1]}, profile cpu-default): stopped" in r.stdout
    assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    # `stop` removes no pidfile: the server did, on SIGTERM, although uvicorn re-raises the signal.
    assert not path.exists()
    assert json.loads(run_cli("ps", "--json", env=env).stdout) == []
    assert "Shutting down" in (Path(env["NINFER_STATE_DIR"]) / "logs" / f"serve-{detached[1]}.log").read_text()
