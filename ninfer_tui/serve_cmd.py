"""`ninfer serve` (foreground or --detach), `ninfer ps`, `ninfer stop`."""
from __future__ import annotations

import argparse
import ipaddress
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

from engine.errors import NinferError, UserError

from . import paths
from .launch import add_engine_args, profile_from_args


def add_parsers(sub) -> None:
    s = sub.add_parser("serve", help="serve the OpenAI- and Anthropic-compatible API")
    add_engine_args(s)
    s.add_argument("--host", help="bind address (default: the profile's, 127.0.0.1)")
    s.add_argument("--port", type=int, help="port (default: the profile's, 8080)")
    s.add_argument("--api-key", help="require this key (default: $NINFER_API_KEY; none = no auth)")
    s.add_argument("--served-model-name", action="append", default=[], help="another name clients may use")
    s.add_argument("--cors", action="append", default=[], metavar="ORIGIN", help="allow a browser origin")
    s.add_argument("--detach", "-d", action="store_true", help="run in the background; return once ready")
    s.add_argument("--wait", type=float, default=900, help="seconds --detach waits for the model to load")
    p = sub.add_parser("ps", help="list running ninfer servers")
    p.add_argument("--json", action="store_true")
    t = sub.add_parser("stop", help="stop ninfer servers (SIGTERM, then SIGKILL)")
    t.add_argument("pid", nargs="?", type=int)
    t.add_argument("--all", action="store_true")
    t.add_argument("--timeout", type=float, default=10.0)


def run_dir() -> Path:
    return paths.state_dir() / "servers"


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_port(host: str, port: int) -> None:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as exc:
            raise UserError(f"cannot listen on {host}:{port}: {exc.strerror}",
                            hint="pick another --port, or see what runs there with `ninfer ps`") from None


def run_serve(args: argparse.Namespace) -> int:
    profile = profile_from_args(args)
    api_key = args.api_key or os.environ.get("NINFER_API_KEY") or None
    check_port(profile.host, profile.port)
    if args.detach:
        return _detach(args, profile)
    if not _is_loopback(profile.host) and not api_key:
        print(f"warning: listening on {profile.host} without an API key: anyone who can reach this machine can "
              "use the model (set --api-key or NINFER_API_KEY)", file=sys.stderr)
    import uvicorn

    from engine import Engine
    from engine.server.app import create_app
    from engine.server.bridge import ServerSettings
    from engine.server.lifecycle import own_record, write_record

    from .models import resolve

    model_path = resolve(profile.model)
    config = profile.engine_config(model_path)  # bad settings fail before the server starts
    model_id = Path(profile.model).name if os.sep in profile.model else profile.model
    settings = ServerSettings(
        model_id=model_id, aliases=tuple(args.served_model_name), api_key=api_key, profile=profile.name,
        sampling_defaults={k: getattr(profile.sampling, k) for k in profile.sampling.__dataclass_fields__},
        cors_origins=tuple(args.cors))
    app = create_app(settings, lambda: Engine(config))
    record = write_record(run_dir(), own_record(profile.host, profile.port, profile.name, model_id,
                                                os.environ.get("NINFER_SERVE_LOG", "")))
    print(f"ninfer serving {model_id} (profile {profile.name}) on http://{profile.host}:{profile.port}  "
          f"[OpenAI /v1/chat/completions, Anthropic /v1/messages]", file=sys.stderr)
    import logging

    logging.basicConfig(level=logging.INFO, format="%(levelname)s:     %(name)s: %(message)s")
    try:
        uvicorn.run(app, host=profile.host, port=profile.port, log_level="info", timeout_graceful_shutdown=5)
    finally:
        record.unlink(missing_ok=True)
    return 0


def _detach(args: argparse.Namespace, profile) -> int:
    from engine.server.lifecycle import ServerRecord, wait_ready

    argv = [a for a in args.argv if a not in ("--detach", "-d")]
    log_dir = paths.state_dir() / "logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    log = log_dir / f"serve-{profile.port}.log"
    env = {**os.environ, "NINFER_SERVE_LOG": str(log), "PYTHONUNBUFFERED": "1"}
    with log.open("ab") as out:
        proc = subprocess.Popen([sys.executable, "-m", "ninfer_tui.cli", *argv], stdin=subprocess.DEVNULL,
                                stdout=out, stderr=subprocess.STDOUT, start_new_session=True, env=env)
    url = ServerRecord(proc.pid, profile.host, profile.port, "", "", 0).url
    print(f"starting ninfer server (pid {proc.pid}, log {log}) ...", file=sys.stderr)
    state = wait_ready(url, lambda: proc.poll() is None, args.wait)
    if state and state.get("status") == "ready":
        print(f"ready: {url} (pid {proc.pid}, profile {profile.name}, model {state.get('model')}); "
              f"stop it with `ninfer stop {proc.pid}`")
        return 0
    if proc.poll() is None:
        proc.terminate()
    tail = "\n".join(log.read_text(errors="replace").splitlines()[-15:])
    why = (state or {}).get("error") or ("it exited" if proc.poll() is not None else "it did not become ready")
    print(f"error: the server did not start: {why}\n--- last lines of {log} ---\n{tail}", file=sys.stderr)
    return 1


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


def run_ps(args: argparse.Namespace) -> int:
    from engine.server.lifecycle import health, list_servers

    rows = []
    for r in list_servers(run_dir()):
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
    from engine.server.lifecycle import list_servers, stop

    servers = list_servers(run_dir())
    if args.all:
        targets = servers
    elif args.pid is not None:
        targets = [r for r in servers if r.pid == args.pid]
        if not targets:
            raise UserError(f"PID {args.pid} is not a running ninfer server started on this machine",
                            hint="`ninfer ps` lists them; ninfer stops nothing else")
    elif len(servers) == 1:
        targets = servers
    elif not servers:
        print("no ninfer servers running")
        return 0
    else:
        raise UserError(f"{len(servers)} ninfer servers are running", hint="name a PID or pass --all")
    failed = False
    for r in targets:
        try:
            print(f"{r.pid} ({r.url}, profile {r.profile}): {stop(r, args.timeout)}")
        except NinferError as exc:
            failed = True
            print(f"{r.pid}: {exc}", file=sys.stderr)
    return 1 if failed else 0
