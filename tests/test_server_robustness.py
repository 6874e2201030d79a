"""`ninfer serve` against hostile and clumsy clients, through real HTTP on loopback (raw sockets where a client
closes early, sends a chunked body or sends its headers slowly). One server for the module, with ONE running slot
and two queue places, so a leaked slot wedges it: after every case the running/pending gauges must be back at 0
and a normal request must be answered."""
import http.client
import importlib.util
import json
import math
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from .conftest import ROOT, idle, run_cli
from .server_util import Server, free_port

MODEL = "smollm2-135m"
CHAT = [{"role": "user", "content": "Hi"}]
LONG = {"model": MODEL, "prompt": "1, 2, 3, 4, 5, 6, 7,", "max_tokens": 300, "temperature": 0}  # no early EOS


def _load_soak():
    """scripts/soak_serve.py, whose raw-socket clients these tests share."""
    spec = importlib.util.spec_from_file_location("soak_serve", ROOT / "scripts" / "soak_serve.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


soak = _load_soak()


class Serve(Server):
    """`ninfer serve` in a subprocess, its state, config and home directories private to the module, its log in
    a file the tests read."""

    def __init__(self, home: Path, model_path: str, *args: str) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = home / "serve.log"
        env = {**os.environ, "HOME": str(home), "XDG_CONFIG_HOME": str(home / "config"),
               "XDG_DATA_HOME": str(home / "data"), "XDG_STATE_HOME": str(home / "state"),
               "NINFER_CONFIG_DIR": str(home / "ninfer-config"), "NINFER_DATA_DIR": str(home / "ninfer-data"),
               "NINFER_STATE_DIR": str(home / "ninfer-state")}
        env.pop("NINFER_API_KEY", None)
        with self.log.open("wb") as out:
            self.proc = subprocess.Popen([sys.executable, "-m", "ninfer_tui.cli", "serve", "--profile", "cpu-default",
                                          "--model", model_path, "--port", str(self.port), *args], cwd=ROOT, env=env,
                                         stdout=out, stderr=subprocess.STDOUT)
        self.wait_ready(self.log.read_text)

    def request(self, method: str, path: str, body: bytes | dict | None = None, headers: dict | None = None,
                timeout: float = 60) -> tuple[int, dict]:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)
        try:
            raw = json.dumps(body).encode() if isinstance(body, dict) else body
            conn.request(method, path, body=raw, headers={"content-type": "application/json", **(headers or {})})
            r = conn.getresponse()
            data = r.read()
            return r.status, json.loads(data) if data else {}
        finally:
            conn.close()

    def health(self) -> dict:
        return self.request("GET", "/health", timeout=10)[1]

    def metric(self, name: str) -> float:
        return self.metrics().get(name, 0.0)

    def gauges(self) -> tuple[int, int]:
        h = self.health()
        return h["running"], h["pending"]

    def wait_gauges(self, want: tuple[int, int], within: float) -> tuple[int, int]:
        deadline = time.monotonic() + within
        while (got := self.gauges()) != want and time.monotonic() < deadline:
            time.sleep(0.05)
        return got

    def wait_metric(self, name: str, want: float, within: float) -> float:
        """The metric once it is `want`, or as it is after `within` s: a request's thread counts its end after
        the engine gave its place back, which the gauges show at once."""
        deadline = time.monotonic() + within
        while (got := self.metric(name)) != want and time.monotonic() < deadline:
            time.sleep(0.05)
        return got

    def assert_serves(self) -> None:
        """Nothing left running or queued, and a normal request is answered (with one slot, a leak wedges it)."""
        assert self.wait_gauges((0, 0), 20) == (0, 0)
        status, body = self.request("POST", "/v1/completions", {"model": MODEL, "prompt": "Hi", "max_tokens": 1},
                                    timeout=60)
        assert status == 200 and body["usage"]["completion_tokens"] == 1
        assert self.gauges() == (0, 0)


@pytest.fixture(scope="module")
def server(tmp_path_factory, default_model_path):
    s = Serve(tmp_path_factory.mktemp("serve-home"), default_model_path, "--max-concurrency", "1",
              "--max-pending-requests", "2", "--any-model-name")
    yield s
    s.stop()


def _connect(server: Serve) -> socket.socket:
    return socket.create_connection(("127.0.0.1", server.port), timeout=30)


def _post_raw(server: Serve, path: str, body: dict) -> socket.socket:
    """A request sent on a socket of our own, whose answer is not read."""
    raw = json.dumps(body).encode()
    s = _connect(server)
    s.sendall(soak.post_head("127.0.0.1", server.port, path, len(raw)) + raw)
    return s


def _cancelled(route: str) -> str:
    """The metric of the requests to `route` that ended cancelled."""
    return f'ninfer_requests_total{{route="{route}",status="cancelled"}}'


# --- slots: a 400 after admission, streams closed at once ---------------------------------------------------------

BAD_STREAM = [
    ("/v1/completions", {"model": MODEL, "prompt": "Hi", "max_tokens": 2, "stream": "yes"}),
    ("/v1/completions", {"model": MODEL, "prompt": "Hi", "max_tokens": 2, "stream": True, "stream_options": 5}),
    ("/v1/messages", {"model": MODEL, "messages": CHAT, "max_tokens": 2, "stream": "yes"}),
    ("/v1/responses", {"model": MODEL, "input": "Hi", "max_output_tokens": 2, "stream": 1}),
    ("/v1/chat/completions", {"model": MODEL, "messages": CHAT, "max_tokens": 2, "stream": True,
                              "stream_options": "usage"}),
]


@pytest.mark.parametrize("path,body", BAD_STREAM, ids=[f"{p}-{i}" for i, (p, _) in enumerate(BAD_STREAM)])
def test_a_400_for_a_bad_stream_field_holds_no_slot(server, path, body):
    status, answer = server.request("POST", path, body)
    assert status == 400 and "stream" in json.dumps(answer)
    server.assert_serves()


@pytest.mark.parametrize("path,body", [
    ("/v1/messages", {"model": MODEL, "messages": CHAT, "max_tokens": 50, "stream": True}),
    ("/v1/responses", {"model": MODEL, "input": "Hi", "max_output_tokens": 50, "stream": True}),
    ("/v1/chat/completions", {"model": MODEL, "messages": CHAT, "max_tokens": 50, "stream": True}),
], ids=["messages", "responses", "chat"])
def test_streams_whose_client_closes_at_once_give_their_slot_back(server, path, body):
    for i in range(4):
        s = _post_raw(server, path, body)
        if i % 3:
            time.sleep(0.01 * i)
        soak.reset(s) if i % 2 else s.close()
    server.assert_serves()


# --- disconnects ---------------------------------------------------------------------------------------------------

def test_a_non_streaming_request_is_cancelled_when_its_client_leaves(server):
    before, generated = server.metric(_cancelled("completions")), server.metric("ninfer_completion_tokens_total")
    s = _post_raw(server, "/v1/completions", LONG)
    assert server.wait_gauges((1, 0), 30) == (1, 0)
    time.sleep(0.3)
    s.close()
    assert server.wait_gauges((0, 0), 60) == (0, 0)
    assert server.wait_metric(_cancelled("completions"), before + 1, 10) == before + 1  # not at max_tokens
    assert server.metric("ninfer_completion_tokens_total") - generated < LONG["max_tokens"]
    server.assert_serves()


def test_a_queued_request_whose_client_leaves_leaves_the_queue(server):
    before = server.metric(_cancelled("chat.completions"))
    running = _post_raw(server, "/v1/completions", LONG)
    assert server.wait_gauges((1, 0), 30) == (1, 0)
    queued = _post_raw(server, "/v1/chat/completions", {"model": MODEL, "messages": CHAT, "max_tokens": 5})
    assert server.wait_gauges((1, 1), 30) == (1, 1)
    soak.reset(queued)
    assert server.wait_gauges((1, 0), 10) == (1, 0)  # out of the queue while the first one still runs
    assert server.wait_metric(_cancelled("chat.completions"), before + 1, 10) == before + 1
    running.close()
    server.assert_serves()


def test_slow_headers_hold_nothing_and_block_no_one(server):
    s = _connect(server)
    head = f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1:{server.port}\r\nContent-Type: application/json\r\n"
    try:
        for i, piece in enumerate(head[k:k + 8] for k in range(0, len(head), 8)):
            s.sendall(piece.encode())
            if i == 3:
                server.assert_serves()  # answered meanwhile
            time.sleep(0.05)
        assert server.gauges() == (0, 0)
    finally:
        s.close()
    server.assert_serves()


# --- no 500 for client input -----------------------------------------------------------------------------------

def _chat(**extra) -> bytes:
    return json.dumps({"model": MODEL, "messages": CHAT, "max_tokens": 2, **extra}).encode()


def _raw_field(path: str, field: str, raw: str) -> bytes:
    base = {"/v1/messages": {"model": MODEL, "messages": CHAT, "max_tokens": 2},
            "/v1/completions": {"model": MODEL, "prompt": "Hi", "max_tokens": 2}}.get(
        path, {"model": MODEL, "messages": CHAT, "max_tokens": 2})
    return json.dumps(base)[:-1].encode() + f', "{field}": {raw}}}'.encode()


NESTED = "[" * 5000 + "]" * 5000
HOSTILE = {
    "temperature-nan": ("/v1/chat/completions", _raw_field("/v1/chat/completions", "temperature", "NaN")),
    "temperature-inf": ("/v1/messages", _raw_field("/v1/messages", "temperature", "Infinity")),
    "temperature-1e999": ("/v1/completions", _raw_field("/v1/completions", "temperature", "1e999")),
    "temperature-huge-int": ("/v1/chat/completions", _raw_field("/v1/chat/completions", "temperature", "9" * 400)),
    "repetition-penalty-nan": ("/v1/completions", _raw_field("/v1/completions", "repetition_penalty", "NaN")),
    "top-p-minus-inf": ("/v1/chat/completions", _raw_field("/v1/chat/completions", "top_p", "-Infinity")),
    "seed-2**70": ("/v1/chat/completions", _chat(seed=2 ** 70)),
    "seed--2**70": ("/v1/messages", _raw_field("/v1/messages", "seed", str(-2 ** 70))),
    "nested-5000": ("/v1/chat/completions", _raw_field("/v1/chat/completions", "metadata", NESTED)),
    "nested-200": ("/v1/messages", _raw_field("/v1/messages", "metadata", "[" * 200 + "]" * 200)),
    "nested-tools": ("/v1/chat/completions", _chat(tools=[{"type": "function", "function": {
        "name": "f", "parameters": json.loads('{"a":' * 300 + "1" + "}" * 300)}}])),
    "surrogate-content": ("/v1/chat/completions",
                          b'{"model": "m", "max_tokens": 2, "messages": [{"role": "user", "content": "a\\ud800b"}]}'),
    "surrogate-system": ("/v1/messages", b'{"model": "m", "max_tokens": 2, "system": "\\udfff", "messages": '
                                         b'[{"role": "user", "content": "Hi"}]}'),
    "surrogate-prompt": ("/v1/completions", b'{"model": "m", "max_tokens": 2, "prompt": "\\ud83d"}'),
    "surrogate-input": ("/v1/responses", b'{"model": "m", "max_output_tokens": 2, "input": "x\\udc00"}'),
    "surrogate-stop": ("/v1/chat/completions", _raw_field("/v1/chat/completions", "stop", '["\\ud800"]')),
    "surrogate-top-key": ("/v1/completions", b'{"model": "m", "max_tokens": 2, "prompt": "Hi", "\\udc80": 1}'),
    "surrogate-key": ("/v1/chat/completions", _raw_field("/v1/chat/completions", "chat_template_kwargs",
                                                         '{"\\ud800": true}')),
    "kwargs-add-generation-prompt": ("/v1/chat/completions",
                                     _chat(chat_template_kwargs={"add_generation_prompt": False})),
    "kwargs-messages": ("/v1/responses", json.dumps({"model": MODEL, "input": "Hi", "max_output_tokens": 2,
                                                     "chat_template_kwargs": {"messages": []}}).encode()),
    "kwargs-tools": ("/v1/messages", json.dumps({"model": MODEL, "messages": CHAT, "max_tokens": 2,
                                                 "chat_template_kwargs": {"tools": 5}}).encode()),
    "kwargs-raise-exception": ("/v1/chat/completions", _chat(chat_template_kwargs={"raise_exception": "x"})),
    "top-logprobs-over-20": ("/v1/chat/completions", _chat(logprobs=True, top_logprobs=21)),
    "top-logprobs-without-logprobs": ("/v1/chat/completions", _chat(top_logprobs=3)),
    "completions-logprobs-over-20": ("/v1/completions", _raw_field("/v1/completions", "logprobs", "21")),
    "n-over-max": ("/v1/chat/completions", _chat(n=17)),
    "completions-echo": ("/v1/completions", _raw_field("/v1/completions", "echo", "true")),
    "responses-top-logprobs-over-20": ("/v1/responses", json.dumps({
        "model": MODEL, "input": "Hi", "max_output_tokens": 2, "include": ["message.output_text.logprobs"],
        "top_logprobs": 21}).encode()),
    "tool-choice-missing-openai": ("/v1/chat/completions", _chat(
        tools=[{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}],
        tool_choice={"type": "function", "function": {"name": "launch_rockets"}})),
    "tool-choice-no-tools": ("/v1/chat/completions", _chat(tool_choice={"type": "function",
                                                                        "function": {"name": "x"}})),
    "tool-choice-missing-anthropic": ("/v1/messages", json.dumps({
        "model": MODEL, "messages": CHAT, "max_tokens": 2, "tool_choice": {"type": "tool", "name": "nope"},
        "tools": [{"name": "get_weather", "input_schema": {"type": "object"}}]}).encode()),
    "tool-choice-missing-responses": ("/v1/responses", json.dumps({
        "model": MODEL, "input": "Hi", "max_output_tokens": 2, "tool_choice": {"type": "function", "name": "nope"},
        "tools": [{"type": "function", "name": "get_weather", "parameters": {"type": "object"}}]}).encode()),
    "image-in-system": ("/v1/messages", json.dumps({
        "model": MODEL, "messages": CHAT, "max_tokens": 2, "system": [
            {"type": "text", "text": "Be brief."},
            {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}}]}
    ).encode()),
    "count-tokens-nan": ("/v1/messages/count_tokens", b'{"model": "m", "messages": [{"role": "user", '
                                                      b'"content": "Hi"}], "x": NaN}'),
}


@pytest.mark.parametrize("case", list(HOSTILE))
def test_client_input_gets_a_400_in_the_apis_shape(server, case):
    path, raw = HOSTILE[case]
    status, body = server.request("POST", path, raw)
    assert status == 400, (case, status, body)
    if path.startswith("/v1/messages"):
        assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
    else:
        assert body["error"]["type"] == "invalid_request_error" and body["error"]["message"]
    server.assert_serves()


def test_a_named_tool_that_exists_is_fine(server):
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    status, body = server.request("POST", "/v1/chat/completions", json.dumps({
        "model": MODEL, "messages": CHAT, "max_tokens": 1, "tools": tools,
        "tool_choice": {"type": "function", "function": {"name": "get_weather"}}}).encode())
    assert status == 200, body
    status, body = server.request("POST", "/v1/messages/count_tokens", {
        "model": MODEL, "messages": CHAT, "tool_choice": {"type": "tool", "name": "get_weather"},
        "tools": [{"name": "get_weather", "input_schema": {"type": "object"}}]})
    assert status == 200 and body["input_tokens"] > 20, body


def test_sampling_params_reject_non_finite_values_and_wild_seeds():
    from engine import SamplingParams
    from engine.errors import UserError

    for bad in ({"temperature": math.nan}, {"temperature": math.inf}, {"repetition_penalty": math.nan},
                {"top_p": math.nan}, {"min_p": math.nan}, {"seed": 2 ** 70}, {"seed": -2 ** 64}):
        with pytest.raises(UserError):
            SamplingParams(**bad)
    assert SamplingParams(seed=2 ** 64 - 1).seed == 2 ** 64 - 1


# --- the event loop and the body limit ---------------------------------------------------------------------------

def test_a_huge_prompt_is_refused_by_its_bytes_without_blocking_the_server(server):
    body = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "word " * 2_000_000}],
                       "max_tokens": 2}).encode()  # 10 MB: under the body limit, far over any window
    result = {}

    def post() -> None:
        result["answer"] = server.request("POST", "/v1/chat/completions", body, timeout=120)

    t = threading.Thread(target=post)
    t.start()
    slowest = 0.0
    while t.is_alive():
        t0 = time.monotonic()
        server.health()
        slowest = max(slowest, time.monotonic() - t0)
        time.sleep(0.02)
    t.join()
    status, answer = result["answer"]
    assert status == 400 and "bytes" in answer["error"]["message"], answer
    assert answer["error"]["code"] == "context_length_exceeded"
    assert slowest < 1.5  # /health answered all along
    server.assert_serves()


def test_a_chunked_body_over_the_limit_gets_413_before_it_is_all_read(server):
    s = _connect(server)
    try:
        s.sendall(soak.post_head("127.0.0.1", server.port, "/v1/chat/completions", None))
        answer, sent = soak.flood_chunked(s, 30)
    finally:
        s.close()
    assert answer.startswith(b"HTTP/1.1 413"), answer[:200]
    assert sent < 48 << 20  # answered without waiting for the (never finished) rest of the body
    server.assert_serves()


# --- auth and exposure ---------------------------------------------------------------------------------------------

def test_a_foreign_origin_or_host_never_runs_a_generation(server):
    generated = server.metric("ninfer_completion_tokens_total")
    text = json.dumps({"model": MODEL, "prompt": "Hi", "max_tokens": 2}).encode()
    plain = {"content-type": "text/plain"}  # a browser's "simple" request: no preflight
    status, body = server.request("POST", "/v1/completions", text, {**plain, "origin": "http://evil.example"})
    assert status == 403 and "evil.example" in body["error"]["message"]
    status, body = server.request("POST", "/v1/completions", text, {**plain, "host": f"evil.example:{server.port}"})
    assert status == 403 and "Host" in body["error"]["message"]
    status, body = server.request("POST", "/v1/messages", json.dumps(
        {"model": MODEL, "messages": CHAT, "max_tokens": 2}).encode(), {**plain, "origin": "null"})
    assert status == 403 and body["type"] == "error" and body["error"]["type"] == "permission_error"
    status, _ = server.request("GET", "/health", None, {"host": "rebound.example"})
    assert status == 403
    assert server.metric("ninfer_completion_tokens_total") == generated
    status, _ = server.request("POST", "/v1/completions", text, {"origin": f"http://localhost:{server.port}",
                                                                 "host": f"localhost:{server.port}"})
    assert status == 200  # a page served from loopback is the user's own
    server.assert_serves()


@pytest.mark.parametrize("how", ["flag", "env"])
def test_an_empty_api_key_is_an_error_not_auth_off(how):
    port = str(free_port())
    args, env = (["--api-key", ""], {}) if how == "flag" else ([], {"NINFER_API_KEY": ""})
    r = run_cli("serve", "--port", port, *args, env=env, timeout=60)
    assert r.returncode == 2 and "empty" in r.stderr and "hint:" in r.stderr, r.stderr


def test_health_shows_a_load_error_only_to_those_with_the_key():
    import uvicorn

    from engine.errors import UserError
    from engine.server.app import create_app
    from engine.server.bridge import ServerSettings

    def fail():
        raise UserError("cannot read /srv/secret/models/private.gguf")

    app = create_app(ServerSettings(model_id="private", api_key="k", host="127.0.0.1"), fail)
    port = free_port()
    srv = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    t = threading.Thread(target=srv.run, daemon=True)
    t.start()
    try:
        deadline = time.monotonic() + 10
        while (not srv.started or app.state.server.status == "loading") and time.monotonic() < deadline:
            time.sleep(0.02)  # the load thread fails at once, once a busy machine runs it
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
        conn.request("GET", "/health")
        r = conn.getresponse()
        open_body = r.read().decode()
        conn.request("GET", "/health", headers={"authorization": "Bearer k"})
        keyed = json.loads(conn.getresponse().read())
        conn.close()
    finally:
        srv.should_exit = True
        t.join(10)
    assert r.status == 503 and "/srv/secret" not in open_body and json.loads(open_body)["model"] == "private"
    assert "/srv/secret/models/private.gguf" in keyed["error"]


# --- issue 54's server bits ------------------------------------------------------------------------------------

def test_any_model_name_and_the_log_line_speeds(server):
    status, body = server.request("POST", "/v1/chat/completions", {"model": "gpt-4o", "messages": CHAT,
                                                                   "max_tokens": 3})
    assert status == 200 and body["model"] == "gpt-4o"
    status, body = server.request("POST", "/v1/messages", {"model": "claude-x", "messages": CHAT, "max_tokens": 3})
    assert status == 200 and body["model"] == "claude-x"
    log = server.log.read_text()
    line = next(ln for ln in reversed(log.splitlines()) if "messages: prompt" in ln)
    assert line.count("tok/s") == 2, line  # prompt and generation speeds


# --- the engine's Stream ------------------------------------------------------------------------------------------

def test_a_stream_closed_or_dropped_unread_gives_its_slot_back(default_engine):
    """Closed before it is read, closed once iteration began, or dropped unread: each request ends (cancelled)
    and its place goes back at the engine core's next step."""
    import gc

    from engine import SamplingParams

    eng = default_engine
    ids = eng.tokenizer.encode("Hi", add_special=True)
    params = SamplingParams(max_tokens=200, temperature=0, ignore_eos=True)
    s = eng.submit(ids, params)
    s.close()
    assert [e for e in s][-1].finish_reason == "cancelled"
    assert idle(eng) == (0, 0)
    s = eng.submit(ids, params)
    events = iter(s)
    next(events)  # a token: it runs
    s.close()
    assert [e for e in events][-1].finish_reason == "cancelled"
    assert idle(eng) == (0, 0)
    s = eng.submit(ids, params)
    del s
    gc.collect()
    assert idle(eng) == (0, 0)
    deadline = time.monotonic() + 10
    while eng.core._thread is not None and time.monotonic() < deadline:
        time.sleep(0.01)
    assert eng.core._thread is None  # with nothing left to run, the loop thread ends (a process may exit)
