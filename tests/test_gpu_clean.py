"""`ninfer gpu-clean` against real processes holding a fake device file: decoys that look like ninfer by name or
arguments (never ended), real ninfer processes (the entry point run from a stand-in package: the same command
line as ninfer's own) that are orphaned, listed, not listed or alive, and one real `ninfer serve` under load that
must survive `--yes`. Every test ends only the PIDs it started."""
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import psutil
import pytest

from engine.server.lifecycle import ServerRecord, ninfer_args, python_target, subcommand, wait_ready, write_record

from .conftest import ROOT, run_cli
from .server_util import free_port

HOLD = "import sys, time; f = open(sys.argv[1]); time.sleep(120)"
# What the stand-in `ninfer_tui.cli` does: hold the fake device, then wait to be ended.
FAKE_CLI = "import os, time\nf = open(os.environ['FAKE_DEVICE'])\ntime.sleep(120)\n"


@pytest.fixture(scope="module")
def home(tmp_path_factory):
    """The state, config and data dirs every process of this module runs with (the live server's pidfile is in
    this state dir), and the fake device they hold."""
    base = tmp_path_factory.mktemp("gpu-clean")
    env = {**os.environ, **{v: str(base / v.lower()) for v in ("NINFER_CONFIG_DIR", "NINFER_DATA_DIR",
                                                                 "NINFER_STATE_DIR")}}
    dev = base / "dev" / "nvidia0"
    dev.parent.mkdir()
    dev.write_text("")
    return base, env, dev


@pytest.fixture(scope="module")
def live_server(home):
    """A real `ninfer serve` (CPU default) holding the fake device through a descriptor it inherits."""
    base, env, dev = home
    port = free_port()
    fd = os.open(dev, os.O_RDONLY)
    try:
        with open(base / "server.log", "wb") as log:  # the server has its own descriptor for it
            proc = subprocess.Popen([sys.executable, "-m", "ninfer_tui.cli", "serve", "--port", str(port)],
                                    cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, pass_fds=(fd,))
    finally:
        os.close(fd)
    url = f"http://127.0.0.1:{port}"
    try:
        state = wait_ready(lambda: url, lambda: proc.poll() is None, 180)
        assert state and state["status"] == "ready", (base / "server.log").read_text()
        yield proc, url
    finally:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


class Started:
    """PIDs this test started (and only those), ended in `finally` after checking each is still the same process."""

    def __init__(self) -> None:
        self.procs: list[psutil.Process] = []

    def add(self, pid: int) -> psutil.Process:
        proc = psutil.Process(pid)
        self.procs.append(proc)
        return proc

    def popen(self, *args, **kw) -> psutil.Process:
        return self.add(subprocess.Popen(*args, **kw).pid)

    def orphan(self, cmd: str, env: dict, cwd: Path) -> psutil.Process:
        """Start `cmd` (a shell command) through a shell that exits at once: its parent is gone."""
        out = subprocess.run(["bash", "-c", f"{cmd} >/dev/null 2>&1 </dev/null & echo $!"], capture_output=True,
                             text=True, env=env, cwd=cwd, check=True)
        return self.add(int(out.stdout.strip()))

    def end_all(self) -> None:
        for proc in self.procs:
            try:
                if proc.is_running():  # psutil compares the create time: a reused PID is not ours
                    proc.kill()
                    proc.wait(5)
            except psutil.Error:
                pass


def _holds(proc: psutil.Process, dev: Path, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if any(os.readlink(f"/proc/{proc.pid}/fd/{fd}") == str(dev) for fd in os.listdir(f"/proc/{proc.pid}/fd")):
                return
        except OSError:
            pass
        time.sleep(0.05)
    raise AssertionError(f"{proc.pid} never opened the fake device: {proc.cmdline()}")


def _clean(env: dict, dev: Path, *args: str) -> dict[int, dict]:
    r = run_cli("gpu-clean", "--device-glob", str(dev), "--json", *args, env=env)
    assert r.returncode == 0, r.stderr
    return {h["pid"]: h for h in json.loads(r.stdout)}


def _gone(proc: psutil.Process) -> bool:
    try:
        return not proc.is_running() or proc.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def _load(url: str, stop: threading.Event, answered: list) -> None:
    """Keep the server generating while gpu-clean looks at it."""
    body = json.dumps({"model": "smollm2-135m", "max_tokens": 8,
                       "messages": [{"role": "user", "content": "Count to twenty."}]}).encode()
    while not stop.is_set():
        req = urllib.request.Request(url + "/v1/chat/completions", body, {"content-type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=120) as r:
                answered.append(r.status)
        except OSError as exc:
            answered.append(repr(exc))


def test_decoys_are_left_alone_and_only_stale_ninfer_processes_end(home, live_server, tmp_path):
    base, env, dev = home
    server, url = live_server
    state_dir = Path(env["NINFER_STATE_DIR"])
    fake = tmp_path / "fakepkg" / "ninfer_tui"  # the same command line as ninfer's: `python -m ninfer_tui.cli`
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("")
    (fake / "cli.py").write_text(FAKE_CLI)
    (fake / "clix.py").write_text(FAKE_CLI)  # a module of the package that is not the entry point
    (tmp_path / "detach.py").write_text("import os, sys; os.setsid(); os.execv(sys.executable, sys.argv)")
    ninfer_env = {**env, "PYTHONPATH": str(fake.parent), "FAKE_DEVICE": str(dev)}
    other_state = {**ninfer_env, "NINFER_STATE_DIR": str(tmp_path / "elsewhere")}
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "ninfer").write_text('#!/bin/bash\nexec 3<"$1"\nexec 4<>"$2"\nread -t 120 -u 4\n')
    (bin_dir / "ninfer").chmod(0o755)
    (tmp_path / "elf").mkdir()
    shutil.copy(shutil.which("sleep"), tmp_path / "elf" / "ninfer")
    (tmp_path / "py").mkdir()
    (tmp_path / "py" / "ninfer").write_text(HOLD)  # a python script named ninfer, not this installation's
    (tmp_path / "train.py").write_text(HOLD)
    notes = tmp_path / "ninfer_tui" / "notes.txt"
    notes.parent.mkdir()
    notes.write_text("")
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    py, d = sys.executable, str(dev)
    started = Started()
    stop_load, answered = threading.Event(), []
    load = threading.Thread(target=_load, args=(url, stop_load, answered), daemon=True)
    me = open(dev)  # the test process, gpu-clean's parent, holds it too
    try:
        decoys = {
            "train": started.orphan(f"{py} train.py {d} --data /srv/datasets/ninfer", env, tmp_path),
            "tail": started.orphan(f"exec 3<{d}; exec tail -f {notes}", env, tmp_path),
            "script": started.orphan(f"{bin_dir / 'ninfer'} {d} {fifo}", env, tmp_path),
            "binary": started.orphan(f"exec 3<{d}; exec {tmp_path / 'elf' / 'ninfer'} 120", env, tmp_path),
            "argv0": started.orphan(f"exec -a ninfer {py} -c '{HOLD}' {d}", env, tmp_path),
            "pyscript": started.orphan(f"{py} {tmp_path / 'py' / 'ninfer'} {d}", env, tmp_path),
            "not-ours-module": started.orphan(f"{py} -m ninfer_tui.clix chat", ninfer_env, tmp_path),
        }
        orphan_chat = started.orphan(f"{py} -m ninfer_tui.cli chat", ninfer_env, tmp_path)
        orphan_elsewhere = started.orphan(f"{py} -m ninfer_tui.cli chat", other_state, tmp_path)
        detached_on_purpose = started.orphan(f"{py} detach.py -m ninfer_tui.cli generate", ninfer_env, tmp_path)
        unlisted_server = started.orphan(f"{py} -m ninfer_tui.cli serve --port 1", ninfer_env, tmp_path)
        with_parent = started.popen([py, "-X", "utf8", "-m", "ninfer_tui.cli", "-P", "x", "generate"],
                                    env=ninfer_env, cwd=tmp_path)
        # A listed server that answers nothing: its pidfile proves it is ninfer's, several checks prove it hung.
        hung = started.orphan(f"{py} -m ninfer_tui.cli serve --port {free_port()}", ninfer_env, tmp_path)
        for proc in [*decoys.values(), orphan_chat, orphan_elsewhere, detached_on_purpose, unlisted_server,
                     with_parent, hung]:
            _holds(proc, dev)
        hung_port = int(hung.cmdline()[-1])
        write_record(state_dir / "servers", ServerRecord(hung.pid, "127.0.0.1", hung_port, "x", "x",
                                                         hung.create_time(), "", hung.exe()))
        load.start()

        seen = _clean(env, dev, "--dry-run")
        for name, proc in decoys.items():
            assert seen[proc.pid]["ninfer"] is False, name
            assert seen[proc.pid]["action"].startswith("none"), name
        assert seen[server.pid]["ninfer"] and not seen[server.pid]["stale"], seen[server.pid]
        assert "answering" in seen[server.pid]["why"]
        assert seen[orphan_chat.pid]["stale"] and seen[orphan_chat.pid]["action"] == "would terminate"
        assert seen[hung.pid]["stale"] and "not answering" in seen[hung.pid]["why"]
        for proc in (orphan_elsewhere, detached_on_purpose, unlisted_server, with_parent):
            assert seen[proc.pid]["ninfer"] and not seen[proc.pid]["stale"], seen[proc.pid]
        assert seen[os.getpid()]["action"] == "none"
        assert all(not _gone(p) for p in started.procs)  # --dry-run ended nothing

        t0 = time.monotonic()
        done = _clean(env, dev, "--yes")
        assert time.monotonic() - t0 > 3  # "not answering" took several checks, seconds apart
        ended = {pid for pid, h in done.items() if not h["action"].startswith("none")}
        assert ended == {orphan_chat.pid, hung.pid}, done
        assert _gone(orphan_chat) and _gone(hung)
        for proc in [*decoys.values(), orphan_elsewhere, detached_on_purpose, unlisted_server, with_parent]:
            assert not _gone(proc), proc.cmdline()
        assert server.poll() is None
        stop_load.set()
        load.join(150)
        assert 200 in answered, answered  # the live server kept answering requests throughout
        with urllib.request.urlopen(url + "/health", timeout=5) as r:
            assert json.loads(r.read())["status"] == "ready"

        # Anything else ends only when named; never this command's parent chain.
        protected = _clean(env, dev, "--pid", str(os.getpid()), "--yes")
        assert protected[os.getpid()]["action"].startswith("protected")
        done = _clean(env, dev, "--pid", str(decoys["train"].pid), "--yes")
        assert done[decoys["train"].pid]["action"] == "terminated" and _gone(decoys["train"])
        assert not _gone(decoys["tail"])
    finally:
        me.close()
        stop_load.set()
        started.end_all()  # a pidfile left by one of them goes at the next scan: its owner is gone


def test_sigterm_ends_the_foreground_server_by_the_signal_and_its_pidfile_goes(home, live_server):
    server = live_server[0]
    path = Path(home[1]["NINFER_STATE_DIR"]) / "servers" / f"{server.pid}.json"
    assert path.exists()
    server.send_signal(signal.SIGTERM)
    assert server.wait(30) == -signal.SIGTERM  # uvicorn shut down gracefully, then raised the signal again
    assert not path.exists()


def test_refuses_unknown_pid_and_needs_confirmation(home, tmp_path):
    _, env, dev = home
    r = run_cli("gpu-clean", "--device-glob", str(dev), "--pid", "999999", env=env)
    assert r.returncode == 2 and "does not hold the GPU" in r.stderr
    started = Started()
    try:
        other = started.popen([sys.executable, "-c", HOLD, str(dev)])
        _holds(other, dev)
        r = run_cli("gpu-clean", "--device-glob", str(dev), "--pid", str(other.pid), env=env)
        assert r.returncode == 2 and "--yes" in r.stderr and not _gone(other)  # no terminal, no --yes
    finally:
        started.end_all()


def test_a_bad_pidfile_is_reported_and_gpu_clean_goes_on(home, tmp_path):
    _, env, dev = home
    servers = Path(env["NINFER_STATE_DIR"]) / "servers"
    servers.mkdir(parents=True, exist_ok=True)
    bad = servers / "424242.json"
    bad.write_text("{not json")
    try:
        r = run_cli("gpu-clean", "--device-glob", str(dev / "none"), "--json", env=env)
        assert r.returncode == 0 and json.loads(r.stdout) == []
        assert str(bad) in r.stderr and "unreadable pidfile" in r.stderr
        assert bad.exists()  # reported, not deleted
    finally:
        bad.unlink()


# ---- what counts as ninfer's entry point (the parsing, on crafted command lines) ------------------------------

PY = "/usr/bin/python3.12"


@pytest.mark.parametrize("cmdline, cwd, want", [
    (["python3", "-m", "ninfer_tui.cli", "serve", "--port", "1"], None, ["serve", "--port", "1"]),
    (["python3", "-m", "ninfer_tui"], None, []),
    (["python3", "-u", "-X", "utf8", "-W", "ignore", "-m", "ninfer_tui.cli", "chat"], None, ["chat"]),
    (["python3", "-Bum", "ninfer_tui.cli", "chat"], None, ["chat"]),
    (["python3", "-mninfer_tui.cli", "ps"], None, ["ps"]),
    (["python3", "/venv/bin/ninfer", "serve"], None, ["serve"]),
    (["python3", "bin/ninfer", "chat"], "/venv", ["chat"]),
    (["ninfer", "/venv/bin/ninfer"], None, []),
    (["python3", "/elsewhere/bin/ninfer", "serve"], None, None),  # another script called ninfer
    (["python3", "train.py", "--data", "/srv/datasets/ninfer"], None, None),
    (["python3", "-c", "import ninfer_tui.cli", "ninfer"], None, None),
    (["python3", "-m", "ninfer_tui.clix"], None, None),
    (["python3", "-W", "-m", "ninfer_tui.cli"], None, None),  # -m is -W's value; the script is ninfer_tui.cli
    (["python3", "-X", "-m", "ninfer_tui.cli"], None, None),
    (["python3", "-", "-m", "ninfer_tui.cli"], None, None),
    (["python3", "--", "-m"], None, None),
    (["python3"], None, None),
])
def test_ninfer_entry_point_from_the_command_line(cmdline, cwd, want):
    assert ninfer_args(PY, cmdline, cwd, scripts={"/venv/bin/ninfer"}) == want


@pytest.mark.parametrize("exe", ["/usr/bin/tail", "/tmp/elf/ninfer", "/bin/bash", "/usr/bin/ninfer", ""])
def test_only_an_interpreter_runs_ninfer(exe):
    assert ninfer_args(exe, ["python3", "-m", "ninfer_tui.cli", "serve"], None, scripts=set()) is None


def test_python_options_and_subcommands():
    assert python_target(["-X", "utf8", "--check-hash-based-pycs", "never", "x.py", "a"]) == ("script", "x.py", ["a"])
    assert python_target(["--version"]) is None
    assert subcommand(["--profile", "serve", "chat"]) == "chat"
    assert subcommand(["-P", "p", "serve", "--port", "1"]) == "serve"
    assert subcommand([]) == "chat"  # bare `ninfer`: the app or a piped chat


def test_this_installations_console_script_counts(tmp_path):
    script = Path(sys.executable).parent / "ninfer"
    if not script.is_file():
        pytest.skip("no console script beside the interpreter (not an installed environment)")
    assert ninfer_args(sys.executable, [sys.executable, str(script), "serve"], None) == ["serve"]
    copy = tmp_path / "ninfer"
    shutil.copy(script, copy)
    assert ninfer_args(sys.executable, [sys.executable, str(copy), "serve"], None) is None


def test_terminate_never_ends_a_reused_pid():
    from ninfer_tui.gpu_clean import terminate

    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        created = psutil.Process(proc.pid).create_time()
        assert terminate(proc.pid, created - 5).startswith("already gone")  # listed as another process
        assert proc.poll() is None
        assert terminate(proc.pid, created) == "terminated"
        assert proc.wait(5) == -signal.SIGTERM
    finally:
        if proc.poll() is None:
            proc.kill()
