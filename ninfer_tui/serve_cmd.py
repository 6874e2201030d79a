"""`ninfer serve` (foreground or --detach), `ninfer ps`, `ninfer stop`."""
from __future__ import annotations

import argparse
import ipaddress
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from engine.errors import UserError

from . import paths
from .launch import add_engine_args, profile_from_args


def add_parsers(sub) -> None:
    s = sub.add_parser("serve", help="serve the OpenAI- and Anthropic-compatible API")
    add_engine_args(s)
    s.add_argument("--host", help="bind address (default: the profile's, 127.0.0.1)")
    s.add_argument("--port", type=int, help="port (default: the profile's, 8080)")
    s.add_argument("--api-key", help="require this key (default: $NINFER_API_KEY; none = no auth)")
    s.add_argument("--served-model-name", action="append", default=[], help="another name clients may use")
    s.add_argument("--any-model-name", action="store_true",
                   help="answer requests whatever model name they give (default: 404 for names not served)")
    s.add_argument("--cors", action="append", default=[], metavar="ORIGIN", help="allow a browser origin")
    s.add_argument("--image-urls", action="store_true",
                   help="fetch the http(s) image URLs requests name (default: only inline images; a server that "
                   "fetches can be made to reach what its host reaches)")
    s.add_argument("--image-urls-private", action="store_true",
                   help="with --image-urls, fetch URLs naming loopback, private or link-local addresses too "
                   "(default: public addresses only)")
    s.add_argument("--detach", "-d", action="store_true", help="run in the background; return once ready")
    s.add_argument("--wait", type=float, default=900, help="seconds --detach waits for the model to load")
    # Set by --detach on the server it starts: a failed load ends that process, with the cause in its log.
    s.add_argument("--detached-child", action="store_true", help=argparse.SUPPRESS)
    p = sub.add_parser("ps", help="list running ninfer servers")
    p.add_argument("--json", action="store_true", help="print the list as JSON")
    t = sub.add_parser("stop", help="stop ninfer servers (SIGTERM, then SIGKILL)")
    t.add_argument("pid", nargs="?", type=int)
    t.add_argument("--all", action="store_true", help="stop every running ninfer server")
    t.add_argument("--timeout", type=float, default=10.0, help="seconds between SIGTERM and SIGKILL")


def run_dir() -> Path:
    return paths.state_dir() / "servers"


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def bind(host: str, port: int) -> socket.socket:
    """The server's socket, bound before the pidfile is written and handed to uvicorn: no other process can take
    the port in between."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
        family, kind, proto, _, address = min(infos, key=lambda info: info[0] != socket.AF_INET)  # IPv4 first
        sock = socket.socket(family, kind, proto)
    except OSError as exc:
        raise UserError(f"cannot listen on {host}:{port}: {exc.strerror or exc}",
                        hint="give --host an address of this machine (127.0.0.1 for this machine only)") from None
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(address)
    except OSError as exc:
        sock.close()
        raise UserError(f"cannot listen on {host}:{port}: {exc.strerror}",
                        hint="pick another --port, or see what runs there with `ninfer ps`") from None
    return sock


def check_port(host: str, port: int) -> None:
    bind(host, port).close()


def warn_exposure(host: str, api_key: str | None) -> None:
    if not _is_loopback(host) and not api_key:
        print(f"warning: listening on {host} without an API key: anyone who can reach this machine can "
              "use the model (set --api-key or NINFER_API_KEY)", file=sys.stderr)


def preflight(profile) -> tuple[str, object]:
    """The model reference and engine config, checked before anything starts: the model's name or path (pulled
    if it is a registry model not cached yet) and the profile's settings. Cheap (no torch), so --detach runs it
    before it starts the server; the server then checks the rest before it binds (`_check_before_bind`)."""
    from .models import resolve

    model_path = resolve(profile.model)
    return model_path, profile.engine_config(model_path)


def _check_before_bind(model_path: str, config) -> None:
    """What the engine would refuse at load and can be told without loading: the model file's format (and its
    vision projector's), settings whose implementation has not landed."""
    from engine.engine import check_supported
    from engine.loaders import read_spec

    check_supported(config)
    read_spec(model_path, config.vision, config.mmproj)


class _Terminated(BaseException):
    """SIGTERM, raised in the main thread wherever it is, so the `finally` that removes the pidfile runs: uvicorn
    shuts down gracefully on SIGTERM and then raises the signal again with the previous handler (this one)."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


def _raise_terminated(signum: int, frame) -> None:
    raise _Terminated(signum)


def run_serve(args: argparse.Namespace) -> int:
    profile = profile_from_args(args)
    from engine.server.bridge import api_key_from

    api_key = api_key_from(args.api_key, os.environ.get("NINFER_API_KEY"))
    check_port(profile.host, profile.port)
    if args.detach:
        preflight(profile)
        return _detach(args, profile, api_key)
    previous = signal.signal(signal.SIGTERM, _raise_terminated)
    try:
        return _serve(args, profile, api_key)
    except _Terminated as stop:
        # End by the signal, as uvicorn means to, now that the pidfile is gone.
        signal.signal(stop.signum, signal.SIG_DFL)
        signal.raise_signal(stop.signum)
        return 128 + stop.signum
    finally:
        signal.signal(signal.SIGTERM, previous)


def _serve(args: argparse.Namespace, profile, api_key: str | None) -> int:
    import logging

    import uvicorn

    from engine import Engine
    from engine.server.app import create_app
    from engine.server.bridge import ServerSettings
    from engine.server.lifecycle import own_record, pidfile, reachable_urls, write_record

    model_path, config = preflight(profile)
    _check_before_bind(model_path, config)
    warn_exposure(profile.host, api_key)
    model_id = Path(profile.model).name if os.sep in profile.model else profile.model
    settings = ServerSettings(
        model_id=model_id, aliases=tuple(args.served_model_name), api_key=api_key, profile=profile.name,
        sampling_defaults={k: getattr(profile.sampling, k) for k in profile.sampling.__dataclass_fields__},
        cors_origins=tuple(args.cors), host=profile.host, any_model_name=args.any_model_name,
        image_urls=args.image_urls, image_urls_private=args.image_urls_private)
    failed: list[BaseException] = []
    server: uvicorn.Server | None = None

    def load():
        try:
            return Engine(config)
        except BaseException as exc:
            if args.detached_child:  # nobody reads its /health: it ends with the load's error for --detach to show
                failed.append(exc)
                server.should_exit = True
            raise

    app = create_app(settings, load)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s:     %(name)s: %(message)s")
    sock = bind(profile.host, profile.port)
    try:  # the socket and the pidfile go on every way out (a SIGTERM raises _Terminated anywhere in here)
        port = sock.getsockname()[1]
        server = uvicorn.Server(uvicorn.Config(app, host=profile.host, port=port, log_level="info",
                                               timeout_graceful_shutdown=5))
        write_record(run_dir(), own_record(profile.host, port, profile.name, model_id,
                                           os.environ.get("NINFER_SERVE_LOG", "")))
        print(f"ninfer serving {model_id} (profile {profile.name}) on {reachable_urls(profile.host, port)[0]}  "
              f"[OpenAI /v1/chat/completions, Anthropic /v1/messages]", file=sys.stderr)
        server.run(sockets=[sock])
    finally:
        sock.close()
        pidfile(run_dir(), os.getpid()).unlink(missing_ok=True)
    if failed:
        raise failed[0]
    if not server.started:
        print("error: the server did not start (see the lines above)", file=sys.stderr)
        return 1
    return 0


def _log_for(port: int) -> Path:
    """The detached server's log: one per port, appended to (a run's own lines start at the size it had)."""
    log_dir = paths.state_dir() / "logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    return log_dir / f"serve-{port}.log"


def _detach(args: argparse.Namespace, profile, api_key: str | None) -> int:
    from engine.server.lifecycle import pidfile, reachable_urls, read_record, wait_ready

    cut = args.argv.index("--") if "--" in args.argv else len(args.argv)
    argv = [a for a in args.argv[:cut] if a not in ("--detach", "-d")] + ["--detached-child"] + args.argv[cut:]
    log = _log_for(profile.port)
    start = log.stat().st_size if log.exists() else 0
    env = {**os.environ, "NINFER_SERVE_LOG": str(log), "PYTHONUNBUFFERED": "1"}
    with log.open("ab") as out:
        proc = subprocess.Popen([sys.executable, "-m", "ninfer_tui.cli", *argv], stdin=subprocess.DEVNULL,
                                stdout=out, stderr=subprocess.STDOUT, start_new_session=True, env=env)
    print(f"starting ninfer server (pid {proc.pid}, log {log}) ...", file=sys.stderr)
    warn_exposure(profile.host, api_key)
    record_path = pidfile(run_dir(), proc.pid)

    def url_of() -> str | None:
        try:
            return read_record(record_path).url
        except (OSError, ValueError):  # not written yet
            return None

    try:
        state = wait_ready(url_of, lambda: proc.poll() is None, args.wait)
        if state and state.get("status") == "error" and proc.poll() is None:
            _wait(proc, 30)  # it ends itself after a failed load, with the cause in its log
    except KeyboardInterrupt:
        _end(proc)
        raise
    if proc.poll() is None and state and state.get("status") == "ready":
        record = read_record(record_path)
        urls = reachable_urls(record.host, record.port)
        also = f"; also at {', '.join(urls[1:])}" if len(urls) > 1 else ""
        print(f"ready: {urls[0]} (pid {proc.pid}, profile {profile.name}, model {state.get('model')}{also}); "
              f"stop it with `ninfer stop {proc.pid}`")
        return 0
    lines = _run_lines(log, start)
    if proc.poll() is None:
        _end(proc)
        why = (state or {}).get("error") or f"it did not become ready within {args.wait:g} s"
        print(f"error: the server did not start: {why}\n--- its log ({log}) ---\n" + "\n".join(lines[-15:]),
              file=sys.stderr)
        return 1
    said = [line for line in lines if line.startswith(("error:", "hint:", "internal error:"))]
    if said:  # the server's own words (its log's path is on the "starting" line)
        print("\n".join(said), file=sys.stderr)
    else:
        print(f"error: the server exited (code {proc.returncode}) before it was ready\n--- its log ({log}) ---\n"
              + "\n".join(lines[-15:]), file=sys.stderr)
    return 2 if proc.returncode == 2 else 1


def _run_lines(log: Path, start: int) -> list[str]:
    """This run's lines of the log (from the size it had before the run)."""
    with log.open("rb") as f:
        f.seek(start)
        return f.read().decode(errors="replace").splitlines()


def _wait(proc: subprocess.Popen, timeout: float) -> None:
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        pass


def _end(proc: subprocess.Popen) -> None:
    proc.terminate()
    _wait(proc, 15)
    if proc.poll() is None:
        proc.kill()
        proc.wait()


def _gpu_mem_mib(pid: int) -> int | None:
    try:
        import pynvml
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
        for i in range(pynvml.nvmlDeviceGetCount()):
            handle = pynvml.nvmlDeviceGetHandleByIndex(i)
            for p in pynvml.nvmlDeviceGetComputeRunningProcesses(handle):
                if p.pid == pid and p.usedGpuMemory:
                    return p.usedGpuMemory >> 20
    except pynvml.NVMLError:
        return None
    return None


def report_skipped(problems) -> None:
    """Pidfiles that could not be used: said with their path, never deleted (they may be someone's)."""
    for path, why in problems:
        print(f"warning: skipped {path}: {why}", file=sys.stderr)


def run_ps(args: argparse.Namespace) -> int:
    from engine.server.lifecycle import health, scan_servers

    scan = scan_servers(run_dir())
    report_skipped(scan.problems)
    rows = []
    for r in scan.servers:
        h = health(r.url, timeout=0.5) or {}
        rows.append({"pid": r.pid, "url": r.url, "host": r.host, "port": r.port, "profile": r.profile,
                     "model": r.model, "status": h.get("status", "not answering"),
                     "uptime_s": round(time.time() - r.started, 1), "gpu_mem_mib": _gpu_mem_mib(r.pid),
                     "log": r.log})
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    if not rows:
        print("no ninfer servers running")
        return 0
    print(f"{'PID':>8s}  {'URL':26s} {'PROFILE':14s} {'MODEL':16s} {'STATUS':12s} {'UPTIME':>8s} {'GPU MiB':>8s}")
    for r in rows:
        gpu = "-" if r["gpu_mem_mib"] is None else str(r["gpu_mem_mib"])
        print(f"{r['pid']:>8d}  {r['url']:26s} {r['profile']:14s} {r['model']:16s} {r['status']:12s} "
              f"{r['uptime_s']:>7.0f}s {gpu:>8s}")
    return 0


def run_stop(args: argparse.Namespace) -> int:
    from engine.server.lifecycle import pidfile, scan_servers, stop

    scan = scan_servers(run_dir())
    report_skipped(scan.problems)
    servers = scan.servers
    if args.all:
        targets = servers
    elif args.pid is not None:
        targets = [r for r in servers if r.pid == args.pid]
        if not targets:
            why = next((w for p, w in scan.problems if p == pidfile(run_dir(), args.pid)), None)
            raise UserError(f"PID {args.pid} is not a running ninfer server started on this machine"
                            + (f" ({why})" if why else ""), hint="`ninfer ps` lists them; ninfer stops nothing else")
    elif len(servers) == 1:
        targets = servers
    elif not servers:
        print("no ninfer servers running")
        return 0
    else:
        raise UserError(f"{len(servers)} ninfer servers are running", hint="name a PID or pass --all")
    failed = False
    for r in targets:
        what = stop(r, args.timeout)
        failed |= what.startswith("not ")
        print(f"{r.pid} ({r.url}, profile {r.profile}): {what}")
    return 1 if failed else 0
