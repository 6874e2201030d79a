"""Soak `ninfer serve` with a mix of normal and hostile clients for a bounded time, on loopback only.

Starts `ninfer serve` (the CPU default unless --serve-args say otherwise; its pidfile and log in a private temp dir,
which is kept for the log)
or attaches to --url, then runs --clients threads that pick cases at random until --seconds have passed: normal
requests of every route, streamed and not; bodies that must get a 4xx (NaN and huge numbers, wild seeds, JSON
nested thousands deep, lone surrogates, reserved chat_template_kwargs, logprobs, a tool_choice naming a missing
tool, an image in an Anthropic system, bad `stream` types); a prompt of megabytes; a chunked body over the limit
with no Content-Length; early closes through raw sockets (at once, after the first bytes, with a reset, a
non-streamed request left after a moment); slow headers; a foreign Origin and Host. Reports requests by case and
status, any 5xx, the running/pending gauges once settled, a normal request answered at the end, and the server's
RSS before and after (when it started the server, or with --pid).

Usage: python scripts/soak_serve.py [--seconds 600] [--clients 4] [--url http://127.0.0.1:8080] [--pid PID]
                                    [--serve-args "--max-concurrency 1"] [--out scripts/results/soak_serve.json]
Bounded: --seconds, plus at most --timeout for requests in flight and a minute for the gauges to settle.
"""
from __future__ import annotations

import argparse
import http.client
import ipaddress
import json
import os
import random
import select
import shlex
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path
from urllib.parse import urlsplit

import psutil

ROOT = Path(__file__).resolve().parent.parent
CHAT = [{"role": "user", "content": "Name three fruits."}]


class Target:
    def __init__(self, host: str, port: int, model: str, timeout: float) -> None:
        self.host, self.port, self.model, self.timeout = host, port, model, timeout

    def request(self, method: str, path: str, body: bytes | dict | None = None, headers: dict | None = None) -> \
            tuple[int, bytes]:
        conn = http.client.HTTPConnection(self.host, self.port, timeout=self.timeout)
        try:
            raw = json.dumps(body).encode() if isinstance(body, dict) else body
            conn.request(method, path, body=raw, headers={"content-type": "application/json", **(headers or {})})
            r = conn.getresponse()
            return r.status, r.read()
        finally:
            conn.close()

    def health(self) -> dict:
        status, body = self.request("GET", "/health")
        return json.loads(body)

    def connect(self) -> socket.socket:
        return socket.create_connection((self.host, self.port), timeout=self.timeout)

    def head(self, path: str, length: int | None) -> bytes:
        return post_head(self.host, self.port, path, length)


# --- raw-socket clients (tests/test_server_robustness.py uses them too) ------------------------------------------

FLOOD_CAP = 48 << 20  # what flood_chunked sends at most: more than any body limit a server should have


def post_head(host: str, port: int, path: str, length: int | None) -> bytes:
    """The head of a raw POST of a JSON body: with a Content-Length, or chunked when `length` is None."""
    size = f"Content-Length: {length}\r\n" if length is not None else "Transfer-Encoding: chunked\r\n"
    return (f"POST {path} HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n"
            f"{size}\r\n").encode()


def flood_chunked(s: socket.socket, timeout: float) -> tuple[bytes, int]:
    """After a chunked head, send 1 MiB chunks of a body that never ends until the server's answer head is in, the
    server closes, FLOOD_CAP bytes are sent or `timeout` passes. Returns the answer so far and the bytes sent."""
    piece = b"x" * (1 << 20)
    chunk = f"{len(piece):x}\r\n".encode() + piece + b"\r\n"
    sent, answer, deadline = 0, b"", time.monotonic() + timeout
    s.setblocking(False)
    while time.monotonic() < deadline and b"\r\n\r\n" not in answer:
        readable, writable, _ = select.select([s], [s] if sent < FLOOD_CAP else [], [], 0.5)
        if readable:
            data = s.recv(65536)
            if not data:
                break
            answer += data
        elif writable:
            try:
                sent += s.send(chunk[sent % len(chunk):])
            except BlockingIOError:
                pass
    return answer, sent


def reset(s: socket.socket) -> None:
    """Close with a TCP reset rather than a FIN (a killed client)."""
    s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    s.close()


OVERLOADED = 529  # the Anthropic API's "overloaded" (with retry-after), its 429: an answer, not a server error


def _status_line(data: bytes) -> str:
    parts = data.split(b" ", 2)
    return parts[1].decode() if len(parts) > 1 and data.startswith(b"HTTP/") else "no-answer"


# --- cases: each returns its status label -----------------------------------------------------------------------

def normal_cases(t: Target) -> dict:
    m = t.model
    return {
        "chat": lambda: t.request("POST", "/v1/chat/completions", {"model": m, "messages": CHAT, "max_tokens": 8}),
        "chat-stream": lambda: t.request("POST", "/v1/chat/completions", {
            "model": m, "messages": CHAT, "max_tokens": 8, "stream": True, "stream_options": {"include_usage": True}}),
        "completions": lambda: t.request("POST", "/v1/completions", {"model": m, "prompt": "Once upon",
                                                                      "max_tokens": 8}),
        "messages": lambda: t.request("POST", "/v1/messages", {"model": m, "messages": CHAT, "max_tokens": 8}),
        "messages-stream": lambda: t.request("POST", "/v1/messages", {"model": m, "messages": CHAT, "max_tokens": 8,
                                                                       "stream": True}),
        "responses-stream": lambda: t.request("POST", "/v1/responses", {"model": m, "input": "Hi",
                                                                         "max_output_tokens": 8, "stream": True}),
        "count-tokens": lambda: t.request("POST", "/v1/messages/count_tokens", {"model": m, "messages": CHAT}),
        "models": lambda: t.request("GET", "/v1/models"),
        "health": lambda: t.request("GET", "/health"),
    }


def _raw(t: Target, path: str, extra: dict, raw_field: str | None = None) -> bytes:
    base = {"/v1/messages": {"model": t.model, "messages": CHAT, "max_tokens": 4},
            "/v1/completions": {"model": t.model, "prompt": "Hi", "max_tokens": 4},
            "/v1/responses": {"model": t.model, "input": "Hi", "max_output_tokens": 4}}.get(
        path, {"model": t.model, "messages": CHAT, "max_tokens": 4})
    text = json.dumps({**base, **extra})
    return (text[:-1] + f", {raw_field}}}" if raw_field else text).encode()


def hostile_bodies(t: Target) -> dict:
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    return {
        "nan-temperature": ("/v1/chat/completions", _raw(t, "/v1/chat/completions", {}, '"temperature": NaN')),
        "inf-penalty": ("/v1/completions", _raw(t, "/v1/completions", {}, '"repetition_penalty": Infinity')),
        "huge-int-temperature": ("/v1/messages", _raw(t, "/v1/messages", {}, '"temperature": ' + "9" * 400)),
        "seed-2**70": ("/v1/chat/completions", _raw(t, "/v1/chat/completions", {"seed": 2 ** 70})),
        "nested-5000": ("/v1/chat/completions", _raw(t, "/v1/chat/completions", {},
                                                     '"metadata": ' + "[" * 5000 + "]" * 5000)),
        "surrogate": ("/v1/messages", _raw(t, "/v1/messages", {}, '"system": "\\ud800"')),
        "surrogate-prompt": ("/v1/completions", _raw(t, "/v1/completions", {}, '"suffix": null, "user": "\\udfff"')),
        "reserved-kwargs": ("/v1/chat/completions", _raw(t, "/v1/chat/completions", {
            "chat_template_kwargs": {"add_generation_prompt": False, "messages": []}})),
        "logprobs": ("/v1/chat/completions", _raw(t, "/v1/chat/completions", {"logprobs": True, "top_logprobs": 2})),
        "missing-tool": ("/v1/chat/completions", _raw(t, "/v1/chat/completions", {
            "tools": tools, "tool_choice": {"type": "function", "function": {"name": "nope"}}})),
        "image-in-system": ("/v1/messages", _raw(t, "/v1/messages", {"system": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}}]})),
        "bad-stream-type": ("/v1/completions", _raw(t, "/v1/completions", {"stream": "yes"})),
        "bad-stream-options": ("/v1/completions", _raw(t, "/v1/completions", {"stream": True, "stream_options": 3})),
        "bad-stream-messages": ("/v1/messages", _raw(t, "/v1/messages", {"stream": "yes"})),
        "bad-stream-responses": ("/v1/responses", _raw(t, "/v1/responses", {"stream": 1})),
        "not-json": ("/v1/chat/completions", b"{not json"),
        "unknown-model": ("/v1/chat/completions", _raw(t, "/v1/chat/completions", {"model": "gpt-unknown"})),
    }


def huge_prompt(t: Target) -> tuple[int, bytes]:
    size = random.choice((1, 4, 12)) << 20
    return t.request("POST", "/v1/chat/completions", {"model": t.model, "max_tokens": 4, "messages": [
        {"role": "user", "content": "word " * (size // 5)}]})


def chunked_over_limit(t: Target) -> str:
    """A chunked body with no Content-Length, never finished: the 413 must come once the limit is passed, before
    the FLOOD_CAP bytes this client would send."""
    s = t.connect()
    try:
        s.sendall(t.head("/v1/chat/completions", None))
        answer, sent = flood_chunked(s, t.timeout)
        return _status_line(answer) + ("" if sent < FLOOD_CAP else "-after-all")
    except OSError:
        return "reset-by-server"
    finally:
        s.close()


def early_close(t: Target, path: str, body: dict, after: str) -> str:
    raw = json.dumps(body).encode()
    s = t.connect()
    s.sendall(t.head(path, len(raw)) + raw)
    if after == "first-bytes":
        s.recv(256)
    elif after == "a-moment":
        time.sleep(random.uniform(0.1, 1.0))
    reset(s) if after == "reset" or random.random() < 0.5 else s.close()
    return "closed-early"


def slow_headers(t: Target) -> str:
    s = t.connect()
    try:
        head = t.head("/v1/completions", 10).decode()
        for i in range(0, len(head) - 2, 6):
            s.sendall(head[i:i + 6].encode())
            time.sleep(0.1)
        return "closed-early"
    finally:
        s.close()


def hostile_cases(t: Target) -> dict:
    long_gen = {"model": t.model, "prompt": "1, 2, 3, 4, 5,", "max_tokens": 200}
    stream_msg = {"model": t.model, "messages": CHAT, "max_tokens": 64, "stream": True}
    cases = {name: (lambda p=path, b=raw: t.request("POST", p, b)) for name, (path, raw) in hostile_bodies(t).items()}
    cases.update({
        "huge-prompt": lambda: huge_prompt(t),
        "chunked-over-limit": lambda: chunked_over_limit(t),
        "close-at-once-messages": lambda: early_close(t, "/v1/messages", stream_msg, "at-once"),
        "close-at-once-responses": lambda: early_close(t, "/v1/responses", {
            "model": t.model, "input": "Hi", "max_output_tokens": 64, "stream": True}, "at-once"),
        "close-after-first-bytes": lambda: early_close(t, "/v1/chat/completions", {**stream_msg}, "first-bytes"),
        "reset-stream": lambda: early_close(t, "/v1/messages", stream_msg, "reset"),
        "leave-non-streamed": lambda: early_close(t, "/v1/completions", long_gen, "a-moment"),
        "slow-headers": lambda: slow_headers(t),
        "foreign-origin": lambda: t.request("POST", "/v1/completions", _raw(t, "/v1/completions", {}),
                                            {"content-type": "text/plain", "origin": "http://evil.example"}),
        "foreign-host": lambda: t.request("POST", "/v1/completions", _raw(t, "/v1/completions", {}),
                                          {"content-type": "text/plain", "host": "rebound.example"}),
    })
    return cases


# --- the run -------------------------------------------------------------------------------------------------------

def start_server(port: int, extra: list[str], home: Path) -> subprocess.Popen:
    env = {**os.environ, "NINFER_STATE_DIR": str(home / "state"), "PYTHONUNBUFFERED": "1"}
    with (home / "serve.log").open("wb") as log:
        return subprocess.Popen([sys.executable, "-m", "ninfer_tui.cli", "serve", "--host", "127.0.0.1", "--port",
                                 str(port), *extra], cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)


def wait_ready(t: Target, proc: subprocess.Popen | None, within: float = 300) -> dict:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise SystemExit("the server exited while loading")
        try:
            h = t.health()
            if h.get("status") == "ready":
                return h
        except (OSError, ValueError):
            pass
        time.sleep(0.3)
    raise SystemExit("the server did not become ready")


def rss_mib(pid: int | None) -> float | None:
    try:
        return round(psutil.Process(pid).memory_info().rss / (1 << 20), 1) if pid else None
    except psutil.Error:
        return None


def soak(t: Target, seconds: float, clients: int, hostile_share: float) -> tuple[Counter, list[str]]:
    normal, hostile = normal_cases(t), hostile_cases(t)
    results: Counter = Counter()
    errors: list[str] = []
    lock = threading.Lock()
    deadline = time.monotonic() + seconds

    def client(seed: int) -> None:
        rng = random.Random(seed)
        while time.monotonic() < deadline:
            pool = hostile if rng.random() < hostile_share else normal
            name = rng.choice(list(pool))
            try:
                out = pool[name]()
                status = str(out[0]) if isinstance(out, tuple) else out
                if isinstance(out, tuple) and out[0] >= 500 and out[0] != OVERLOADED:
                    with lock:
                        errors.append(f"{name}: {out[0]} {out[1][:300]!r}")
            except TimeoutError:
                status = "client-timeout"
            except OSError as exc:
                status = f"conn-error:{type(exc).__name__}"
            with lock:
                results[(name, status)] += 1

    threads = [threading.Thread(target=client, args=(i,)) for i in range(clients)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    return results, errors


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seconds", type=float, default=600)
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--hostile-share", type=float, default=0.6, help="share of picks from the hostile cases")
    ap.add_argument("--url", help="attach to this server (loopback only) instead of starting one")
    ap.add_argument("--pid", type=int, help="the attached server's PID, for its RSS")
    ap.add_argument("--serve-args", default="--profile cpu-default",
                    help="`ninfer serve` arguments (default: the CPU default profile), e.g. '--max-concurrency 1'")
    ap.add_argument("--timeout", type=float, default=120, help="seconds a request may take")
    ap.add_argument("--out", default=str(ROOT / "scripts" / "results" / "soak_serve.json"))
    args = ap.parse_args()

    proc, home = None, None
    if args.url:
        u = urlsplit(args.url)
        host, port = u.hostname or "", u.port or 80
    else:
        host, port = "127.0.0.1", _free_port()
    if not (host == "localhost" or ipaddress.ip_address(host).is_loopback):
        raise SystemExit(f"{host} is not a loopback address: this soak only runs against a server on this machine")
    t = Target(host, port, "", args.timeout)
    if not args.url:
        home = Path(tempfile.mkdtemp(prefix="ninfer-soak-"))
        proc = start_server(port, shlex.split(args.serve_args), home)
    pid = proc.pid if proc is not None else args.pid
    try:
        t.model = wait_ready(t, proc)["model"]
        rss_before = rss_mib(pid)
        t0 = time.monotonic()
        results, errors = soak(t, args.seconds, args.clients, args.hostile_share)
        elapsed = time.monotonic() - t0
        deadline, h = time.monotonic() + 60, t.health()
        while (h["running"], h["pending"]) != (0, 0) and time.monotonic() < deadline:
            time.sleep(0.5)
            h = t.health()
        final, _ = t.request("POST", "/v1/chat/completions", {"model": t.model, "messages": CHAT, "max_tokens": 4})
        rss_after = rss_mib(pid)
    finally:
        if proc is not None:
            proc.terminate()
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                proc.kill()
    by_status = Counter()
    for (_, status), n in results.items():
        by_status[status] += n
    five_xx = sum(n for (_, status), n in results.items()
                  if status.isdigit() and int(status) >= 500 and int(status) != OVERLOADED)
    summary = {"seconds": round(elapsed, 1), "clients": args.clients, "requests": sum(results.values()),
               "by_status": dict(sorted(by_status.items())), "five_xx": five_xx, "five_xx_samples": errors[:10],
               "running_at_end": h["running"], "pending_at_end": h["pending"], "final_request_status": final,
               "rss_before_mib": rss_before, "rss_after_mib": rss_after, "model": t.model,
               "server": args.url or f"ninfer serve {args.serve_args}".strip(),
               "server_log": str(home / "serve.log") if home else None}
    rows = [{"case": name, "status": status, "count": n} for (name, status), n in sorted(results.items())]
    print(f"{'case':28s} {'status':24s} {'count':>6s}")
    for r in rows:
        print(f"{r['case']:28s} {r['status']:24s} {r['count']:>6d}")
    print(json.dumps(summary, indent=2))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"summary": summary, "rows": rows}, indent=2))
    print(f"-> {out}")
    ok = five_xx == 0 and (h["running"], h["pending"]) == (0, 0) and final == 200
    return 0 if ok else 1


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


if __name__ == "__main__":
    sys.exit(main())
