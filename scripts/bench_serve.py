"""Serving benchmark (issue 45, item 7): `ninfer serve` driven over HTTP by N concurrent streaming clients.

Starts `ninfer serve --profile P [--model M] [--set KEY=VALUE ...]` on a free loopback port (its HOME, XDG and
ninfer config/data/state dirs in a private temp dir, so no pidfile or session lands in yours; the model, kernel and
Triton caches stay shared; its log in that dir, printed when it fails) or attaches to --url, waits for /health to
say ready, and runs a fixed, seeded workload of OpenAI chat requests (`/v1/chat/completions`, stream=true,
stream_options.include_usage, temperature 0): the speed check's code task (`ninfer_tui/speedcheck.py`'s TASK) and a
chat mix of synthesised code-review and note-summary prompts of about 200, 500, 1K, 2K, 4K and 8K tokens (each
prompt cut to --max-prompt-tokens and to the server's context less --max-tokens; sizes set with the server's own
token count, /v1/messages/count_tokens, else chars/4).

Scenario `concurrency` (default): for each N of --concurrency, N client threads each send --requests-per-client
requests back to back (request k = j*N + i of the pass takes workload item k mod W), each asking --max-tokens.
Per N: aggregate tok/s (completion tokens of every request, from usage, over the pass's wall time), TTFT p50/p99
(request sent -> first content/reasoning delta; a 429/503 answer is retried after its retry-after, and the time
counts), ITL p50/p99 per token (the server streams a chunk per token, text it holds back, for a stop string or a
split character, coming with a later one, so chunks are counted as tokens; chunks that arrive within --burst-ms of
each other, a speculative round's tokens, form one burst, and each of its tokens gets (burst's last arrival -
previous burst's last arrival) / chunks in the burst; pooled over requests; itl_max_gap_ms is the longest wait
between two chunks), TPOT p50/p99 (per request: first to
last token over tokens - 1), and the drafts' acceptance when the server exposes drafted/accepted counters in
/metrics or /health (today it does not: acceptance is null). A warm-up pass (on unless --no-warmup) first sends
every workload item once at concurrency 1, unmeasured: kernels get compiled and a recording drafter sees the
target's greedy continuations.

Scenario `prefill-during-decode`: --background requests (4) decode the task with a long max_tokens; once each has
streamed --lead-tokens tokens, one request with a --long-prompt-tokens (32768) prompt arrives. Reported: the 4's
ITL p50/p99 during its prefill (the window from its send to its first token) against before it, their tok/s in
both windows, the long prompt's TTFT (its prefill time), and with --alone (on) its TTFT sent alone, so
prefill_speed_ratio = alone TTFT / mixed TTFT (the mixed prefill's speed as a share of its speed alone).

A server this script starts gets `held_sequences = 0` (the workload repeats prompts, and a held conversation would
serve them without a prefill; --keep-held leaves the profile's), `max_pending_requests` >= the largest N, and for
prefill-during-decode `max_concurrency` >= background + 1 and a `max_context`/`kv_capacity` that hold the long prompt
beside the background requests; each such change is printed and recorded. Each scenario gets a server of its own.
The server reports neither its spec settings nor acceptance: `spec`, `draft_tokens` and `settings` come from the
profile with the --set keys on top.

Output: a table, and rows merged into scripts/results/bench_serve_<gpu>.json (or $OUT/, or --out): one per
measurement with gpu, profile, model, spec, draft_tokens, acceptance, scenario, concurrency, aggregate_tok_s,
ttft_p50_s, ttft_p99_s, itl_p50_ms, itl_p99_ms, tpot, token and error counts, date, command and settings; a new row
replaces an old one of the same gpu, model, profile, spec settings, scenario, concurrency and workload.

Usage:
  CPU smoke:  python scripts/bench_serve.py --profile cpu-default --concurrency 1,2 --requests-per-client 1 \\
                  --max-tokens 16 --max-prompt-tokens 600 --no-warmup
              python scripts/bench_serve.py --profile cpu-default --scenario prefill-during-decode \\
                  --long-prompt-tokens 1500 --no-warmup
  GPU, 8k-speed (DFlash K=7 at the reference run's 59.6% acceptance: random weights accept nothing, so the
  benchmark drafter replays the warm-up's greedy output, right at that rate, while the DFlash drafter still runs):
              python scripts/bench_serve.py --profile 8k-speed --model synthetic:qwen3.6-27b \\
                  --set drafter=synthetic:dflash-qwen3.6-27b --set draft_acceptance=0.596
  GPU, multi-user (no drafts; then with them):
              python scripts/bench_serve.py --profile multi-user --model synthetic:qwen3.6-27b
              python scripts/bench_serve.py --profile multi-user --model synthetic:qwen3.6-27b --set spec=dflash \\
                  --set drafter=synthetic:dflash-qwen3.6-27b --set draft_acceptance=0.596
  GPU, a 32K prompt while 4 requests decode (max_context and the pool grow to hold it):
              python scripts/bench_serve.py --profile multi-user --model synthetic:qwen3.6-27b \\
                  --scenario prefill-during-decode
  Against a running server: --url http://127.0.0.1:8080 (--profile and --set then only describe it).
"""
from __future__ import annotations

import argparse
import ast
import functools
import http.client
import json
import os
import random
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

ROOT = Path(__file__).resolve().parent.parent
SIZES = (200, 500, 1000, 2000, 4000, 8000)  # the chat mix's prompt sizes, in tokens
MARGIN = 64  # tokens kept free of the context beside a prompt and its max_tokens (the template's own, rounding)
SCENARIOS = ("concurrency", "prefill-during-decode")
# Per-test/ per-run dirs the started server gets of its own; the caches (models, kernel tiles, Triton) stay shared.
PRIVATE_DIRS = ("HOME", "XDG_CONFIG_HOME", "XDG_DATA_HOME", "XDG_STATE_HOME", "NINFER_CONFIG_DIR",
                "NINFER_DATA_DIR", "NINFER_STATE_DIR")
FALLBACK_TASK = ("You are an expert Python developer. Write a complete, production-quality Python module "
                 "`lru_ttl.py` that implements a thread-safe LRU cache with per-entry time-to-live, then a pytest "
                 "suite for it, and explain the design briefly at the end.")


# --- the workload ------------------------------------------------------------------------------------------------

@functools.cache
def speedcheck_task() -> str:
    """The speed check's fixed task, read from its source (importing the module would import the engine)."""
    try:
        tree = ast.parse((ROOT / "ninfer_tui" / "speedcheck.py").read_text())
    except (OSError, SyntaxError):
        return FALLBACK_TASK
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "TASK" for t in node.targets) \
                and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str):
            return node.value.value
    return FALLBACK_TASK


NOUNS = ("buffer", "cache", "record", "packet", "token", "account", "order", "invoice", "sensor", "frame", "batch",
         "queue", "node", "edge", "matrix", "vector", "window", "session", "ledger", "setting", "shard", "route")
VERBS = ("parse", "merge", "filter", "load", "store", "update", "scale", "encode", "decode", "split", "flush",
         "resolve", "render", "validate", "collect", "index", "compact", "retry")
ATTRS = ("size", "count", "weight", "offset", "price", "level", "score", "delay", "limit", "rate", "age", "depth")
WORDS = ("the", "team", "agreed", "that", "release", "should", "wait", "for", "review", "of", "migration", "plan",
         "budget", "risk", "customer", "report", "latency", "quarter", "owner", "deadline", "next", "week", "data",
         "service", "storage", "cost", "metric", "design", "draft", "test", "coverage", "incident", "follow", "up",
         "with", "vendor", "contract", "hiring", "backlog", "priority", "roadmap", "security", "audit", "a", "is",
         "on", "after", "before", "because", "and", "but", "not", "yet", "clear", "who", "decides")


def code_block(rng: random.Random) -> str:
    verb, noun, attr = rng.choice(VERBS), rng.choice(NOUNS), rng.choice(ATTRS)
    a, b, c = rng.randint(2, 999), rng.randint(0, 99), rng.randint(2, 9)
    kind = rng.randrange(3)
    if kind == 0:
        return (f"def {verb}_{noun}s(items, limit={a}):\n"
                f'    """{verb.capitalize()} the {noun}s in `items`, at most `limit` of them."""\n'
                "    result = []\n"
                "    for i, item in enumerate(items):\n"
                "        if i >= limit:\n"
                "            break\n"
                f"        if item.{attr} > {b}:\n"
                f"            result.append(item.{attr} * {c} + i)\n"
                "    return result\n\n\n")
    if kind == 1:
        name = noun.capitalize() + verb.capitalize() + "er"
        return (f"class {name}:\n"
                f"    def __init__(self, {attr}={a}):\n"
                f"        self.{attr} = {attr}\n"
                f"        self.{noun}s = {{}}\n\n"
                f"    def {verb}(self, key, {noun}):\n"
                f"        if len(self.{noun}s) >= self.{attr}:\n"
                f"            self.{noun}s.pop(next(iter(self.{noun}s)))\n"
                f"        self.{noun}s[key] = {noun}\n"
                f"        return {noun}.{attr} // {c} if {noun} else {b}\n\n\n")
    return (f"async def {verb}_{noun}(client, {noun}_id, retries={c}):\n"
            "    for attempt in range(retries):\n"
            "        try:\n"
            f'            reply = await client.get(f"/{noun}s/{{{noun}_id}}", timeout={b + 1})\n'
            f"            return reply.json()[\"{attr}\"]\n"
            "        except TimeoutError:\n"
            f"            await asyncio.sleep(0.{a} * (attempt + 1))\n"
            f"    raise RuntimeError(\"{verb} {noun} failed\")\n\n\n")


def prose_block(rng: random.Random) -> str:
    sentences = []
    for _ in range(rng.randint(4, 7)):
        words = [rng.choice(WORDS) for _ in range(rng.randint(8, 16))]
        sentences.append(" ".join(words).capitalize() + ".")
    return f"- {rng.choice(NOUNS).capitalize()} ({rng.randint(1, 28)} March): " + " ".join(sentences) + "\n\n"


def body_text(kind: str, seed: int, chars: int) -> str:
    """`chars` characters of synthesised source code or meeting notes, the same for the same seed."""
    rng, parts, size = random.Random(seed), [], 0
    while size < chars:
        parts.append(code_block(rng) if kind == "code" else prose_block(rng))
        size += len(parts[-1])
    return "".join(parts)[:max(chars, 1)]


def wrap(kind: str, body: str) -> str:
    if kind == "code":
        return (f"Here is part of a Python module:\n\n```python\n{body}\n```\n\nReview this code: name its three "
                "biggest problems and show a fixed version of the worst function.")
    return (f"Here are meeting notes:\n\n{body}\n\nSummarise these notes as a bulleted list, then list the open "
            "questions.")


@dataclass
class Item:
    name: str
    kind: str  # "task", "code" or "text"
    seed: int
    target: int  # tokens asked for
    text: str = ""
    tokens: int | None = None  # the server's count of the prompt's tokens (with the template), if it told

    def render(self, chars: int) -> str:
        if self.kind == "task":
            return speedcheck_task()[:chars]
        return wrap(self.kind, body_text(self.kind, self.seed, chars))


# --- HTTP ------------------------------------------------------------------------------------------------------

class Target:
    def __init__(self, host: str, port: int, timeout: float, api_key: str | None) -> None:
        self.host, self.port, self.timeout = host, port, timeout
        self.model = ""
        self.proc: subprocess.Popen | None = None  # the server this script started, if it did
        self.headers = {"content-type": "application/json"}
        if api_key:
            self.headers["authorization"] = f"Bearer {api_key}"

    def request(self, method: str, path: str, body: dict | None = None, timeout: float | None = None) -> \
            tuple[int, bytes]:
        conn = http.client.HTTPConnection(self.host, self.port, timeout=timeout or self.timeout)
        try:
            conn.request(method, path, body=json.dumps(body).encode() if body is not None else None,
                         headers=self.headers)
            r = conn.getresponse()
            return r.status, r.read()
        finally:
            conn.close()

    def check_alive(self) -> None:
        if self.proc is not None and self.proc.poll() is not None:
            raise SystemExit(f"the server exited (status {self.proc.returncode}) during the run")

    def health(self) -> dict:
        _, body = self.request("GET", "/health", timeout=10)
        return json.loads(body)

    def metrics_text(self) -> str:
        status, body = self.request("GET", "/metrics", timeout=10)
        return body.decode(errors="replace") if status == 200 else ""

    def count_tokens(self, text: str) -> int | None:
        """The server's token count of a one-message chat (its template included), or None if it cannot say."""
        try:
            status, body = self.request("POST", "/v1/messages/count_tokens", {
                "model": self.model, "messages": [{"role": "user", "content": text}]}, timeout=120)
            return int(json.loads(body)["input_tokens"]) if status == 200 else None
        except (OSError, ValueError, KeyError, TypeError):
            return None


@dataclass
class Result:
    item: str
    status: int = 0
    error: str | None = None
    t_send: float = 0.0
    t_first: float | None = None
    t_end: float = 0.0
    stamps: list[float] = field(default_factory=list)  # arrival of each chunk that carries generated text
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    finish_reason: str | None = None
    retries: int = 0
    cancelled: bool = False  # closed by the client (`stop`)
    done: bool = False


def stream_chat(t: Target, item: Item, max_tokens: int, extra: dict, text: str | None = None,
                stop: threading.Event | None = None, on_chunk: Any = None, res: Result | None = None) -> Result:
    """One streamed chat request; a 429/503 is retried after its retry-after (the time counts). With `stop`, the
    connection is closed once it is set (after a chunk), which cancels the request. `res`: the Result to fill
    (the caller may read its stamps while it streams); `on_chunk(res)` after each chunk that carries text."""
    res = res if res is not None else Result(item.name)
    body = json.dumps({"model": t.model, "messages": [{"role": "user", "content": text or item.text}],
                       "max_tokens": max_tokens, "temperature": 0, "stream": True, "ignore_eos": True,
                       "stream_options": {"include_usage": True}, **extra}).encode()
    res.t_send = time.perf_counter()
    deadline = res.t_send + t.timeout
    while True:
        conn = http.client.HTTPConnection(t.host, t.port, timeout=t.timeout)
        try:
            conn.request("POST", "/v1/chat/completions", body=body, headers=t.headers)
            r = conn.getresponse()
            res.status = r.status
            if r.status in (429, 503) and time.perf_counter() < deadline:
                r.read()
                res.retries += 1
                time.sleep(min(float(r.getheader("retry-after") or 1), 5.0))
                continue
            if r.status != 200:
                res.error = f"HTTP {r.status}: {r.read()[:300].decode(errors='replace')}"
                break
            _read_stream(r, res, stop, on_chunk)
            break
        except (OSError, http.client.HTTPException, ValueError) as exc:
            res.error = f"{type(exc).__name__}: {exc}"
            break
        finally:
            conn.close()
    res.t_end = time.perf_counter()
    res.done = True
    return res


def _read_stream(r: http.client.HTTPResponse, res: Result, stop: threading.Event | None, on_chunk: Any) -> None:
    while True:
        line = r.readline()
        if not line:
            if res.finish_reason is None and res.error is None:
                res.error = "the stream ended without a finish_reason"
            return
        now = time.perf_counter()
        if not line.startswith(b"data:"):
            continue
        payload = line[5:].strip()
        if payload == b"[DONE]":
            return
        event = json.loads(payload)
        if "error" in event:
            res.error = str(event["error"])[:300]
            return
        if event.get("usage"):
            u = event["usage"]
            res.prompt_tokens, res.completion_tokens = u.get("prompt_tokens", 0), u.get("completion_tokens", 0)
            res.cached_tokens = (u.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
        for choice in event.get("choices") or ():
            delta = choice.get("delta") or {}
            if delta.get("content") or delta.get("reasoning_content") or delta.get("tool_calls"):
                res.stamps.append(now)
                if res.t_first is None:
                    res.t_first = now
                if on_chunk is not None:
                    on_chunk(res)
            res.finish_reason = choice.get("finish_reason") or res.finish_reason
        if stop is not None and stop.is_set():
            res.cancelled = True
            return


# --- statistics --------------------------------------------------------------------------------------------------

def pct(values: list[float], q: float) -> float | None:
    """The q-th percentile (0..100), linear between ranks; None without values."""
    if not values:
        return None
    v = sorted(values)
    rank = (len(v) - 1) * q / 100
    lo = int(rank)
    hi = min(lo + 1, len(v) - 1)
    return v[lo] + (v[hi] - v[lo]) * (rank - lo)


def itl_samples(stamps: list[float], burst_s: float) -> list[tuple[float, float, float]]:
    """Per-token inter-token latencies of one stream: (interval start, interval end, seconds per token), one entry
    per token after the first burst. Chunks within `burst_s` of the previous one form a burst; its tokens share
    the time since the previous burst's last chunk."""
    bursts: list[list[float]] = []
    for s in stamps:
        if bursts and s - bursts[-1][-1] <= burst_s:
            bursts[-1].append(s)
        else:
            bursts.append([s])
    out = []
    for prev, cur in zip(bursts, bursts[1:], strict=False):
        per = (cur[-1] - prev[-1]) / len(cur)
        out.extend((prev[-1], cur[-1], per) for _ in cur)
    return out


def tpot(r: Result) -> float | None:
    return (r.stamps[-1] - r.stamps[0]) / (len(r.stamps) - 1) if len(r.stamps) > 1 else None


def r3(x: float | None, scale: float = 1.0) -> float | None:
    return None if x is None else round(x * scale, 3)


def latency_fields(results: list[Result], burst_s: float) -> dict:
    ok = [r for r in results if r.error is None]
    ttft = [r.t_first - r.t_send for r in ok if r.t_first is not None]
    itl = [s[2] for r in ok for s in itl_samples(r.stamps, burst_s)]
    tp = [x for x in map(tpot, ok) if x is not None]
    gaps = [b - a for r in ok for a, b in zip(r.stamps, r.stamps[1:], strict=False)]
    return {"ttft_p50_s": r3(pct(ttft, 50)), "ttft_p99_s": r3(pct(ttft, 99)),
            "itl_p50_ms": r3(pct(itl, 50), 1e3), "itl_p99_ms": r3(pct(itl, 99), 1e3),
            "itl_max_gap_ms": r3(max(gaps, default=None), 1e3),
            "tpot_p50_ms": r3(pct(tp, 50), 1e3), "tpot_p99_ms": r3(pct(tp, 99), 1e3)}


def count_fields(results: list[Result], max_tokens: int) -> dict:
    ok = [r for r in results if r.error is None]
    errors = [r.error for r in results if r.error is not None]
    return {"requests": len(results), "errors": len(errors), "error_samples": errors[:3],
            "retries_429_503": sum(r.retries for r in results),
            "completion_tokens": sum(r.completion_tokens or (len(r.stamps) if r.cancelled else 0) for r in ok),
            "prompt_tokens_mean": round(sum(r.prompt_tokens for r in ok) / len(ok), 1) if ok else None,
            "cached_tokens": sum(r.cached_tokens for r in ok),
            "stopped_before_max_tokens": sum(r.completion_tokens < max_tokens and not r.cancelled for r in ok)}


# --- acceptance, if the server exposes it ------------------------------------------------------------------------

def _flatten(d: dict, prefix: str = "") -> dict[str, float]:
    out: dict[str, float] = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flatten(v, f"{prefix}{k}."))
        elif isinstance(v, int | float) and not isinstance(v, bool):
            out[prefix + k] = float(v)
    return out


def spec_counters(t: Target) -> tuple[float, float, str] | None:
    """(drafted, accepted, where) from counters the server exposes: Prometheus metrics named *drafted* and
    *accepted* (summed over labels), else numeric /health fields so named. None when there are none."""
    sums: dict[str, float] = {}
    try:
        text = t.metrics_text()
    except OSError:
        text = ""
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        name, _, value = line.rpartition(" ")
        base = name.split("{")[0]
        if base.endswith("_created"):
            continue
        for key in ("drafted", "accepted"):
            if key in base:
                try:
                    sums[key] = sums.get(key, 0.0) + float(value)
                except ValueError:
                    pass
    if len(sums) == 2:
        return sums["drafted"], sums["accepted"], "/metrics"
    try:
        flat = _flatten(t.health())
    except (OSError, ValueError):
        return None
    drafted = [v for k, v in flat.items() if "drafted" in k]
    accepted = [v for k, v in flat.items() if "accepted" in k and "mean" not in k]
    if drafted and accepted:
        return sum(drafted), sum(accepted), "/health"
    return None


def acceptance(before: tuple[float, float, str] | None, after: tuple[float, float, str] | None) -> \
        tuple[float | None, str | None]:
    if before is None or after is None or after[0] <= before[0]:
        return None, (after[2] if after else None)
    return round((after[1] - before[1]) / (after[0] - before[0]), 4), after[2]


# --- the server --------------------------------------------------------------------------------------------------

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def resolve_settings(profile: str, model: str | None, sets: list[str]) -> tuple[dict, bool]:
    """The profile's settings with the --set keys (and --model) on top, and whether it is a built-in one."""
    from ninfer_tui import profiles

    p = profiles.select(profile, profiles.parse_set(sets))
    settings = p.to_dict()
    settings.pop("description", None)
    if model:
        settings["model"] = model
    return settings, p.builtin


def server_env(home: Path, copy_user_profiles: bool) -> dict[str, str]:
    """The started server's environment: HOME, XDG and ninfer dirs of its own under `home`, the caches shared."""
    from ninfer_tui import paths, profiles

    real_home = Path.home()
    env = dict(os.environ)
    shared = {"NINFER_CACHE_DIR": str(paths.cache_dir()), "NINFER_MODELS_DIR": str(paths.models_dir()),
              "XDG_CACHE_HOME": os.environ.get("XDG_CACHE_HOME") or str(real_home / ".cache"),
              "TRITON_HOME": os.environ.get("TRITON_HOME") or str(real_home),
              "CUDA_CACHE_PATH": os.environ.get("CUDA_CACHE_PATH") or str(real_home / ".nv" / "ComputeCache")}
    user_profiles = profiles.user_dir() if copy_user_profiles else None
    for name in PRIVATE_DIRS:
        folder = home / name.lower()
        folder.mkdir(parents=True, exist_ok=True)
        env[name] = str(folder)
    if user_profiles is not None:  # a profile of yours (and those it extends) must still be found
        shutil.copytree(user_profiles, home / "ninfer_config_dir" / "profiles", dirs_exist_ok=True)
    env.update(shared)
    env["PYTHONUNBUFFERED"] = "1"
    return env


class Server:
    """`ninfer serve` in a subprocess on a free loopback port, its log in a private temp dir."""

    def __init__(self, profile: str, model: str | None, sets: list[str], user_profile: bool) -> None:
        self.home = Path(tempfile.mkdtemp(prefix="ninfer-bench-serve-"))
        self.log = self.home / "serve.log"
        self.port = free_port()
        self.args = [sys.executable, "-m", "ninfer_tui.cli", "serve", "--profile", profile,
                     *(["--model", model] if model else []), *(a for s in sets for a in ("--set", s)),
                     "--host", "127.0.0.1", "--port", str(self.port)]
        env = server_env(self.home, user_profile)
        with self.log.open("wb") as log:
            self.proc = subprocess.Popen(self.args, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL)

    def tail(self, lines: int = 40) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)

    def clean(self) -> None:
        shutil.rmtree(self.home, ignore_errors=True)


def wait_ready(t: Target, server: Server | None, within: float) -> dict:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        if server is not None and server.proc.poll() is not None:
            raise SystemExit(f"the server exited while loading (status {server.proc.returncode}); its log "
                             f"{server.log}:\n{server.tail()}")
        try:
            h = t.health()
            if h.get("status") == "ready":
                return h
            if h.get("status") == "error":
                raise SystemExit(f"the server failed to load: {h.get('error')}")
        except (OSError, ValueError):
            pass
        time.sleep(0.3)
    raise SystemExit(f"the server was not ready within {within:.0f} s")


def gpu_tag(device: str) -> str:
    """This machine's GPU name (nvidia-smi, else torch) with '_' for spaces; 'cpu' for a CPU profile or none."""
    if device == "cpu":
        return "cpu"
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader", "-i", "0"],
                             capture_output=True, text=True, timeout=20)
        name = out.stdout.strip().splitlines()[0].strip() if out.returncode == 0 and out.stdout.strip() else ""
    except (OSError, subprocess.TimeoutExpired):
        name = ""
    if not name:
        try:
            import torch

            name = torch.cuda.get_device_name() if torch.cuda.is_available() else ""
        except ImportError:
            name = ""
    return name.replace(" ", "_") if name else "cpu"


def needed_sets(scenario: str, settings: dict, user_keys: set[str], args: argparse.Namespace) -> list[str]:
    """--set keys a started server needs for the scenario to measure what it means to (never one the user set)."""
    want: dict[str, Any] = {}
    if not args.keep_held:
        want["held_sequences"] = 0
    concurrency = max(args.concurrency) if scenario == "concurrency" else args.background + 1
    if settings.get("max_pending_requests", 0) < concurrency:
        want["max_pending_requests"] = concurrency
    if scenario == "prefill-during-decode":
        if settings.get("max_concurrency", 1) < args.background + 1:
            want["max_concurrency"] = args.background + 1
        long_need = args.long_prompt_tokens + args.long_max_tokens + 4 * MARGIN
        context = max(settings.get("max_context", 0), long_need)
        context = -(-context // 1024) * 1024
        if context != settings.get("max_context"):
            want["max_context"] = context
        kv = settings.get("kv_capacity", 0)
        pool = context + args.background * min(context, args.background_tokens + 1024)
        if kv and kv < pool:
            want["kv_capacity"] = -(-pool // 1024) * 1024
    return [f"{k}={v}" for k, v in want.items() if k not in user_keys]


# --- the runs ------------------------------------------------------------------------------------------------------

def build_workload(t: Target, cap: int, seed: int) -> list[Item]:
    """The task and the chat mix, each cut to `cap` tokens (see fit_item); a mix prompt whose wrapper alone is over
    `cap` is left out."""
    targets = sorted({min(s, cap) for s in SIZES})
    rng = random.Random(seed)
    mix = [Item(f"{'code' if i % 2 == 0 else 'text'}-{n}", "code" if i % 2 == 0 else "text", rng.randrange(1 << 30),
                n) for i, n in enumerate(targets)]
    rng.shuffle(mix)
    items = [Item("speedcheck-task", "task", seed, cap), *mix]
    fitted = [item for item in items if fit_item(t, item)]
    left = [item.name for item in items if item not in fitted]
    if left:
        print(f"left out (over {cap} tokens even with almost no text): {', '.join(left)}", flush=True)
    if not fitted:
        raise SystemExit(f"no prompt fits {cap} tokens: raise --max-prompt-tokens")
    return fitted


def fit_item(t: Target, item: Item) -> bool:
    """Size the item's text to about `item.target` tokens (never more) by the server's own count of the chat
    (/v1/messages/count_tokens): the tokens of the wrapper alone and of a chars/4 first try give a rate, then cut
    by 3% until it fits. Without a count, chars/3.2 (tokens run about 3.5 to 4 characters). False if even a
    near-empty body is over the target."""
    chars = len(speedcheck_task()) if item.kind == "task" else 4 * item.target
    most = chars if item.kind == "task" else 16 * item.target
    item.text = item.render(chars)
    n = t.count_tokens(item.text)
    if n is None:
        if item.kind != "task" or len(item.text) > 3.2 * item.target:
            item.text = item.render(int(3.2 * item.target))
        return True
    if n > item.target or item.kind != "task":
        empty = t.count_tokens(item.render(1)) or 0
        if empty >= item.target:
            return False
        rate = max(n - empty, 1) / chars  # tokens a character of the body
        chars = min(most, max(1, int((item.target - empty) / rate)))
        item.text = item.render(chars)
        n = t.count_tokens(item.text) or n
        while n > item.target and chars > 1:
            chars = max(1, int(chars * 0.97))
            item.text = item.render(chars)
            n = t.count_tokens(item.text) or n
    item.tokens = n
    return n <= item.target


def run_pass(t: Target, items: list[Item], n: int, per_client: int, max_tokens: int, extra: dict) -> \
        tuple[list[Result], float]:
    results: list[Result] = []
    lock = threading.Lock()
    go = threading.Barrier(n + 1)

    def client(i: int) -> None:
        go.wait()
        for j in range(per_client):
            r = stream_chat(t, items[(j * n + i) % len(items)], max_tokens, extra)
            with lock:
                results.append(r)

    threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(n)]
    for th in threads:
        th.start()
    go.wait()
    t0 = time.perf_counter()
    for th in threads:
        th.join()
    return results, time.perf_counter() - t0


def concurrency_rows(t: Target, args: argparse.Namespace, base: dict, cap: int) -> list[dict]:
    items = build_workload(t, cap, args.seed)
    sizes = ", ".join(f"{i.name}: {i.tokens if i.tokens is not None else '~' + str(i.target)}" for i in items)
    print(f"workload (prompt tokens): {sizes}", flush=True)
    workload = {"items": [i.name for i in items], "prompt_tokens": [i.tokens for i in items], "seed": args.seed,
                "max_prompt_tokens": cap, "max_tokens": args.max_tokens,
                "requests_per_client": args.requests_per_client}
    if args.warmup:
        t0 = time.perf_counter()
        run_pass(t, items, 1, len(items), args.max_tokens, args.body)
        print(f"warm-up: {len(items)} requests at concurrency 1 in {time.perf_counter() - t0:.1f} s", flush=True)
    rows = []
    print(HEADER, flush=True)
    for n in args.concurrency:
        before = spec_counters(t)
        results, wall = run_pass(t, items, n, args.requests_per_client, args.max_tokens, args.body)
        acc, source = acceptance(before, spec_counters(t))
        counts = count_fields(results, args.max_tokens)
        rows.append({**base, "scenario": "concurrency", "concurrency": n, "acceptance": acc,
                     "acceptance_source": source, "wall_s": round(wall, 3),
                     "aggregate_tok_s": round(counts["completion_tokens"] / wall, 2) if wall > 0 else None,
                     **latency_fields(results, args.burst_ms / 1e3), **counts, "workload": workload})
        print_row(rows[-1])
    return rows


def prefill_during_decode_row(t: Target, args: argparse.Namespace, base: dict, context: int) -> dict:
    burst = args.burst_ms / 1e3
    task = Item("speedcheck-task", "task", args.seed, 0, text=speedcheck_task())
    long_cap = min(args.long_prompt_tokens, context - args.long_max_tokens - MARGIN)
    long_item = Item(f"code-{long_cap}", "code", args.seed + 1, long_cap)
    if not fit_item(t, long_item):
        raise SystemExit(f"the long prompt does not fit {long_cap} tokens")
    task_tokens = t.count_tokens(task.text) or len(task.text) // 3
    bg_tokens = max(1, min(args.background_tokens, context - task_tokens - MARGIN))
    print(f"long prompt: {long_item.tokens or '~' + str(long_cap)} tokens; {args.background} background requests "
          f"of the task ({task_tokens} tokens), up to {bg_tokens} tokens each", flush=True)
    nonce = iter(range(1, 1 << 30))

    def long_text() -> str:  # a prompt of its own each time: no held conversation may serve it
        return f"Request {next(nonce)}. {long_item.text}"

    if args.warmup:  # the task's whole length where a benchmark drafter must learn what the background decodes
        t0 = time.perf_counter()
        stream_chat(t, long_item, args.long_max_tokens, args.body, text=long_text())
        stream_chat(t, task, bg_tokens if base["draft_acceptance_set"] else 8, args.body)
        print(f"warm-up: the long prompt and the task once, {time.perf_counter() - t0:.1f} s", flush=True)
    stop, cond = threading.Event(), threading.Condition()

    def notify(_: Result) -> None:
        with cond:
            cond.notify_all()

    bg = [Result(task.name) for _ in range(args.background)]

    def background(r: Result) -> None:
        stream_chat(t, task, bg_tokens, args.body, stop=stop, on_chunk=notify, res=r)
        notify(r)

    before = spec_counters(t)
    threads = [threading.Thread(target=background, args=(r,), daemon=True) for r in bg]
    for th in threads:
        th.start()
    try:
        wait_for(t, cond, lambda: all(r.done or len(r.stamps) >= args.lead_tokens for r in bg))
        long_res = stream_chat(t, long_item, args.long_max_tokens, args.body, text=long_text())
        end = long_res.t_first or long_res.t_end
        # a chunk after the window closes each stream's gap that spans its end
        wait_for(t, cond, lambda: all(r.done or (r.stamps and r.stamps[-1] > end) for r in bg))
    finally:
        stop.set()
        for th in threads:
            th.join(t.timeout)
    acc, source = acceptance(before, spec_counters(t))
    settle(t)
    alone = stream_chat(t, long_item, args.long_max_tokens, args.body, text=long_text()) if args.alone else None

    t_send, t_first = long_res.t_send, long_res.t_first
    decoding = max((r.stamps[0] for r in bg if r.stamps), default=t_send)  # from here all of them decode
    samples = [s for r in bg for s in itl_samples(r.stamps, burst)]
    before_itl = [s[2] for s in samples if decoding <= s[0] and s[1] <= t_send]
    during_itl = [s[2] for s in samples if t_first is not None and s[1] > t_send and s[0] < t_first]
    during_gaps = [b - a for r in bg for a, b in zip(r.stamps, r.stamps[1:], strict=False)
                   if t_first is not None and b > t_send and a < t_first]
    n_before = sum(decoding < s <= t_send for r in bg for s in r.stamps)
    n_during = sum(t_first is not None and t_send < s <= t_first for r in bg for s in r.stamps)
    mixed_ttft = (t_first - t_send) if t_first is not None else None
    alone_ttft = (alone.t_first - alone.t_send) if alone is not None and alone.t_first is not None else None
    ptoks = long_res.prompt_tokens or long_item.tokens
    counts = count_fields([*bg, long_res, *([alone] if alone else [])], bg_tokens)
    counts.pop("stopped_before_max_tokens")
    lat = latency_fields(bg, burst)
    return {**base, "scenario": "prefill-during-decode", "concurrency": args.background, "acceptance": acc,
            "acceptance_source": source,
            "aggregate_tok_s": round(n_during / mixed_ttft, 2) if mixed_ttft else None,
            "aggregate_tok_s_before": round(n_before / (t_send - decoding), 2) if t_send > decoding else None,
            "ttft_p50_s": lat["ttft_p50_s"], "ttft_p99_s": lat["ttft_p99_s"],
            "itl_p50_ms": r3(pct(during_itl, 50), 1e3), "itl_p99_ms": r3(pct(during_itl, 99), 1e3),
            "itl_max_gap_ms": r3(max(during_gaps, default=None), 1e3),
            "itl_before_p50_ms": r3(pct(before_itl, 50), 1e3), "itl_before_p99_ms": r3(pct(before_itl, 99), 1e3),
            "itl_samples_during": len(during_itl), "itl_samples_before": len(before_itl),
            "tpot_p50_ms": lat["tpot_p50_ms"], "tpot_p99_ms": lat["tpot_p99_ms"],
            "long_prompt_tokens": ptoks, "long_cached_tokens": long_res.cached_tokens,
            "long_ttft_s": r3(mixed_ttft), "long_prefill_tok_s": round(ptoks / mixed_ttft, 1) if mixed_ttft else None,
            "long_ttft_alone_s": r3(alone_ttft),
            "long_prefill_tok_s_alone": round(ptoks / alone_ttft, 1) if alone_ttft else None,
            "prefill_speed_ratio": round(alone_ttft / mixed_ttft, 3) if alone_ttft and mixed_ttft else None,
            "background_ended_early": sum(r.done and not r.cancelled and r.t_end < (t_first or 0) for r in bg),
            **counts,
            "workload": {"background": args.background, "background_tokens": bg_tokens, "task_tokens": task_tokens,
                         "lead_tokens": args.lead_tokens, "long_prompt_tokens": args.long_prompt_tokens,
                         "long_max_tokens": args.long_max_tokens, "seed": args.seed}}


def wait_for(t: Target, cond: threading.Condition, predicate: Any) -> None:
    """Until `predicate()` holds (checked at each notify and every second), the request timeout passes, or the
    server has exited."""
    deadline = time.monotonic() + t.timeout
    with cond:
        while not predicate() and time.monotonic() < deadline:
            t.check_alive()
            cond.wait(1.0)


def settle(t: Target, within: float = 60) -> None:
    """Until the server runs and queues nothing (cancelled requests leave at their next step)."""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        try:
            h = t.health()
            if not h.get("running") and not h.get("pending"):
                return
        except (OSError, ValueError):
            pass
        time.sleep(0.2)


# --- output --------------------------------------------------------------------------------------------------------

HEADER = (f"{'scenario':22s} {'N':>3s} {'reqs':>4s} {'tokens':>6s} {'wall s':>7s} {'tok/s':>8s} "
          f"{'TTFT p50/p99 s':>15s} {'ITL p50/p99 ms':>15s} {'TPOT p50 ms':>11s} {'accept':>6s} {'err':>3s}")


def _f(x: Any, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def print_row(r: dict) -> None:
    print(f"{r['scenario']:22s} {r['concurrency']:3d} {r['requests']:4d} {r['completion_tokens']:6d} "
          f"{_f(r.get('wall_s'), '7.2f')} {_f(r['aggregate_tok_s'], '8.1f')} "
          f"{_f(r['ttft_p50_s'], '7.3f')}/{_f(r['ttft_p99_s'], '<7.3f')} "
          f"{_f(r['itl_p50_ms'], '7.1f')}/{_f(r['itl_p99_ms'], '<7.1f')} {_f(r['tpot_p50_ms'], '11.1f')} "
          f"{_f(r['acceptance'], '6.3f')} {r['errors']:3d}", flush=True)
    if r["scenario"] == "prefill-during-decode":
        print(f"  the {r['concurrency']} decoding: ITL p50/p99 {_f(r['itl_before_p50_ms'], '.1f')}/"
              f"{_f(r['itl_before_p99_ms'], '.1f')} ms before the long prompt, {_f(r['itl_p50_ms'], '.1f')}/"
              f"{_f(r['itl_p99_ms'], '.1f')} ms during its prefill (largest gap {_f(r['itl_max_gap_ms'], '.1f')} "
              f"ms); {_f(r['aggregate_tok_s_before'], '.1f')} -> {_f(r['aggregate_tok_s'], '.1f')} tok/s\n"
              f"  long prompt {r['long_prompt_tokens']} tokens: TTFT {_f(r['long_ttft_s'], '.2f')} s mixed "
              f"({_f(r['long_prefill_tok_s'], '.0f')} tok/s), {_f(r['long_ttft_alone_s'], '.2f')} s alone "
              f"({_f(r['long_prefill_tok_s_alone'], '.0f')} tok/s): mixed/alone speed "
              f"{_f(r['prefill_speed_ratio'], '.2f')}"
              + (f"; {r['background_ended_early']} background request(s) ended before the prefill did"
                 if r["background_ended_early"] else ""), flush=True)


def row_key(r: dict) -> str:
    return json.dumps([r.get(k) for k in ("gpu", "model", "profile", "spec", "draft_tokens", "scenario",
                                          "concurrency", "settings", "workload")], sort_keys=True)


def merge_rows(path: Path, rows: list[dict]) -> None:
    """`rows` into the results file: each replaces an old row of the same key, the others stay."""
    try:
        old = json.loads(path.read_text()) if path.exists() else []
    except ValueError:
        old = []
    new = {row_key(r) for r in rows}
    kept = [r for r in old if isinstance(r, dict) and row_key(r) not in new] if isinstance(old, list) else []
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(kept + rows, indent=2) + "\n")


# --- main ----------------------------------------------------------------------------------------------------------

def int_list(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of integers") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: give positive integers, e.g. 1,2,4")
    return values


def body_fields(items: list[str]) -> dict:
    out = {}
    for item in items:
        key, sep, text = item.partition("=")
        if not sep or not key:
            raise SystemExit(f"--body {item!r} is not KEY=VALUE")
        try:
            out[key] = json.loads(text)
        except ValueError:
            out[key] = text
    return out


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--profile", "-P", help="the server's profile (default: cpu-default; with --url: the one its "
                    "/health names)")
    ap.add_argument("--model", "-m", help="the server's model (default: the profile's)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="a profile key for the server (repeatable), as `ninfer serve --set`")
    ap.add_argument("--url", help="attach to this running server instead of starting one")
    ap.add_argument("--api-key", default=os.environ.get("NINFER_API_KEY"), help="the attached server's key")
    ap.add_argument("--scenario", choices=[*SCENARIOS, "all"], default="concurrency")
    ap.add_argument("--concurrency", type=int_list, default=[1, 2, 4, 8, 16], help="clients at once, e.g. 1,2,4")
    ap.add_argument("--requests-per-client", type=int, default=2, help="requests each client sends back to back")
    ap.add_argument("--max-tokens", type=int, default=256, help="max_tokens of each request")
    ap.add_argument("--max-prompt-tokens", type=int, default=8000, help="the chat mix's largest prompt (tokens)")
    ap.add_argument("--seed", type=int, default=0, help="the workload's seed")
    ap.add_argument("--warmup", action=argparse.BooleanOptionalAction, default=True,
                    help="send the whole workload once at concurrency 1 first, unmeasured")
    ap.add_argument("--burst-ms", type=float, default=1.0,
                    help="chunks closer than this form one burst (a speculative round's tokens) for the ITL")
    ap.add_argument("--long-prompt-tokens", type=int, default=32768, help="prefill-during-decode: the long prompt")
    ap.add_argument("--long-max-tokens", type=int, default=8, help="prefill-during-decode: the long one's max_tokens")
    ap.add_argument("--background", type=int, default=4, help="prefill-during-decode: requests decoding")
    ap.add_argument("--background-tokens", type=int, default=2048,
                    help="prefill-during-decode: their max_tokens (they are cancelled once the prefill is over)")
    ap.add_argument("--lead-tokens", type=int, default=16,
                    help="prefill-during-decode: tokens each background request streams before the long one")
    ap.add_argument("--alone", action=argparse.BooleanOptionalAction, default=True,
                    help="prefill-during-decode: also time the long prompt sent alone")
    ap.add_argument("--keep-held", action="store_true",
                    help="leave the profile's held_sequences (default 0: no held conversation serves a repeat)")
    ap.add_argument("--body", action="append", default=[], metavar="KEY=JSON",
                    help="an extra request field (repeatable), e.g. speculate=false")
    ap.add_argument("--keep-log", action="store_true", help="keep the started server's log (and its temp dir) "
                    "after a run that went well (one that failed keeps it always)")
    ap.add_argument("--timeout", type=float, default=900,
                    help="seconds a request may wait for its answer or its next chunk")
    ap.add_argument("--load-timeout", type=float, default=1800, help="seconds the server may take to load")
    ap.add_argument("--out", type=Path, help="results file (default: scripts/results/bench_serve_<gpu>.json, or "
                    "$OUT/)")
    args = ap.parse_args(argv)
    args.body = body_fields(args.body)
    for name in ("requests_per_client", "max_tokens", "max_prompt_tokens", "long_prompt_tokens",
                 "long_max_tokens", "background", "background_tokens", "lead_tokens"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be at least 1")
    return args


def _terminate(signum: int, frame: Any) -> None:
    raise SystemExit(128 + signum)  # the finally blocks stop the server


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, _terminate)
    command = "python " + " ".join(shlex.quote(a) for a in [os.path.relpath(__file__, ROOT), *sys.argv[1:]])
    target_host, target_port = "127.0.0.1", 0
    if args.url:
        u = urlsplit(args.url)
        target_host, target_port = u.hostname or "127.0.0.1", u.port or 80
        probe = Target(target_host, target_port, args.timeout, args.api_key)
        profile = args.profile or wait_ready(probe, None, args.load_timeout).get("profile") or "cpu-default"
    else:
        profile = args.profile or "cpu-default"
    from ninfer_tui.profiles import parse_set  # after --help: it imports the engine's config module

    user_keys = set(parse_set(args.set))
    settings, builtin = resolve_settings(profile, args.model, args.set)
    gpu = gpu_tag(settings.get("device", "auto"))
    out = args.out or Path(os.environ.get("OUT") or ROOT / "scripts" / "results") / f"bench_serve_{gpu}.json"
    scenarios = SCENARIOS if args.scenario == "all" else (args.scenario,)
    if settings.get("spec", "none") != "none" and settings.get("draft_acceptance", 0) > 0 and not args.warmup:
        print("warning: draft_acceptance is set but --no-warmup: the benchmark drafter learns the greedy output in "
              "the warm-up, so the measured acceptance falls short of the figure set", file=sys.stderr)
    rows: list[dict] = []
    for scenario in scenarios:
        extra = [] if args.url else needed_sets(scenario, settings, user_keys, args)
        if extra:
            print(f"{scenario}: the server gets --set {' --set '.join(extra)}", flush=True)
        run_settings, _ = resolve_settings(profile, args.model, [*args.set, *extra])
        server, ok = None, False
        try:
            if not args.url:
                server = Server(profile, args.model, [*args.set, *extra], not builtin)
                target_port = server.port
            t = Target(target_host, target_port, args.timeout, args.api_key)
            t.proc = server.proc if server is not None else None
            t0 = time.monotonic()
            health = wait_ready(t, server, args.load_timeout)
            t.model = health["model"]
            print(f"server ready in {time.monotonic() - t0:.1f} s: {t.model}, profile {health.get('profile')}"
                  + (f", pid {server.proc.pid}" if server else f", {args.url}"), flush=True)
            spec = run_settings.get("spec", "none")
            base = {"gpu": gpu, "profile": profile, "model": t.model, "spec": spec,
                    "draft_tokens": run_settings.get("draft_tokens") if spec != "none" else 0,
                    "draft_acceptance_set": run_settings.get("draft_acceptance", 0.0) if spec != "none" else 0.0,
                    "date": time.strftime("%Y-%m-%d %H:%M"), "command": command,
                    "settings": {k: v for k, v in run_settings.items() if k not in ("host", "port")},
                    "settings_source": "the profile with --set on top (the server does not report them)"
                    + ("; attached: its own flags are unknown" if args.url else ""),
                    "server_sets": extra, "request_fields": args.body,
                    "server": {k: health[k] for k in ("model", "profile", "lanes", "cuda_graph_sizes",
                                                      "cuda_graph_batches") if k in health}}
            context = int(run_settings.get("max_context", 8192))
            if scenario == "concurrency":
                cap = min(args.max_prompt_tokens, context - args.max_tokens - MARGIN)
                if cap < 16:
                    raise SystemExit(f"--max-tokens {args.max_tokens} leaves no room for a prompt in the "
                                     f"{context}-token context")
                rows += concurrency_rows(t, args, base, cap)
            else:
                rows.append(prefill_during_decode_row(t, args, base, context))
                print(HEADER)
                print_row(rows[-1])
            ok = True
        finally:
            if server is not None:
                server.stop()
                if ok and not args.keep_log:
                    server.clean()
                elif ok:
                    print(f"the server's log: {server.log}")
                else:
                    print(f"the server's log: {server.log}\n{server.tail()}", file=sys.stderr)
            if rows:
                merge_rows(out, rows)
    print(f"-> {out}")
    return 0 if rows and all(r["errors"] == 0 for r in rows) else 1


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:  # the server is stopped by then (main's finally)
        print("interrupted", file=sys.stderr)
        sys.exit(130)
