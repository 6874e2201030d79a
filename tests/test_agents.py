"""Agent clients: the Responses API, prefix stability, `ninfer launch`, and the real Claude Code and Codex CLIs."""
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import openai
import pytest

from engine import Engine, EngineConfig, SamplingParams
from engine.server.anthropic_api import system_text
from ninfer_tui.agents import plan

from .conftest import run_cli, write_tiny
from .test_output_parser import ANSWER, scripted_client

MODEL = "smollm2-135m"
FN_TOOLS = [{"type": "function", "name": "get_weather", "parameters": {"type": "object"}}]


def test_responses_wire_with_the_sdk():
    with scripted_client(ANSWER) as tc:
        c = openai.OpenAI(base_url="http://testserver/v1", api_key="x", http_client=tc, max_retries=0)
        r = c.responses.create(model="m", input="weather?", tools=FN_TOOLS)
        assert r.status == "completed" and [i.type for i in r.output] == ["reasoning", "message", "function_call"]
        assert r.output_text == "Checking." and json.loads(r.output[2].arguments) == {"city": "Paris", "days": 3}
        with c.responses.stream(model="m", input=[{"role": "user", "content": "weather?"}], tools=FN_TOOLS) as s:
            kinds = [e.type for e in s]
            final = s.get_final_response()
        assert kinds[0] == "response.created" and kinds[-1] == "response.completed"
        for k in ("response.output_item.added", "response.output_text.delta", "response.reasoning_text.delta",
                  "response.function_call_arguments.delta", "response.output_item.done"):
            assert k in kinds
        assert final.output[2].call_id.startswith("call_") and final.usage.output_tokens > 0


def test_responses_on_a_real_server(api_server):
    c = openai.OpenAI(base_url=api_server.url + "/v1", api_key="x", max_retries=0)
    r = c.responses.create(model=MODEL, instructions="Be brief.", input="Name a color.", max_output_tokens=8,
                           temperature=0)
    assert r.status in ("completed", "incomplete") and r.usage.input_tokens > 10
    streamed = c.responses.create(model=MODEL, instructions="Be brief.", input="Name a color.", max_output_tokens=8,
                                  temperature=0, stream=True)
    events = list(streamed)
    assert events[-1].response.output_text == r.output_text
    history = [{"role": "user", "content": "Weather in Paris?"},
               {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Paris"}'},
               {"type": "function_call_output", "call_id": "call_1", "output": "18 C"}]
    again = c.responses.create(model=MODEL, input=history, tools=FN_TOOLS, max_output_tokens=4)
    assert again.usage.input_tokens > r.usage.input_tokens
    with pytest.raises(openai.BadRequestError) as e:
        c.responses.create(model=MODEL, input="x " * 9000, max_output_tokens=8)
    assert e.value.body["code"] == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError):
        c.responses.create(model=MODEL, input="hi", previous_response_id="resp_1")


def test_attribution_line_is_dropped():
    blocks = [{"type": "text", "text": "x-anthropic-billing-header: cc_version=2.1; cch=ab12c;"},
              {"type": "text", "text": "You are a coding agent."}]
    assert system_text(blocks) == "You are a coding agent."
    assert system_text("x-anthropic-billing-header: cch=1;\nBe nice.") == "Be nice."


def test_turn_n_plus_1_starts_with_turn_n(tmp_path):
    """The rendered prompt of the next turn extends the previous prompt plus the reply (thinking and tool calls
    kept), so the held sequence serves it."""
    eng = Engine(EngineConfig(model="synthetic:tiny", device="cpu"))
    turn = [{"role": "system", "content": "tools ok"}, {"role": "user", "content": "Weather?"}]
    first = eng.encode_chat(turn, preserve_thinking=True)
    reply = "<think>\nneed a tool\n</think>\n\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n" \
            "</parameter>\n</function>\n</tool_call>"
    assert eng.tokenizer.encode(eng.render_chat(turn, None, True, preserve_thinking=True) + reply)[:len(first)] \
        == first
    call = {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
    turn += [{"role": "assistant", "content": "", "reasoning_content": "need a tool", "tool_calls": [call]},
             {"role": "tool", "content": "18 C"}]
    second = eng.encode_chat(turn, preserve_thinking=True)
    assert second[:len(first)] == first


def test_checkpoint_at_the_last_message_serves_an_edited_message():
    """Claude Code appends to its last user message when it retries: the state checkpoint at that message's start
    is reused, and the output equals a run without reuse."""
    eng = Engine(EngineConfig(model="synthetic:tiny", device="cpu"))
    greedy = SamplingParams(max_tokens=6, temperature=0)
    head = [{"role": "system", "content": "You are an agent. " * 20}, {"role": "user", "content": "first task"},
            {"role": "assistant", "content": "done"}]
    a = eng.encode_chat(head + [{"role": "user", "content": "say hi"}])
    eng.complete(a, greedy)
    b = eng.encode_chat(head + [{"role": "user", "content": "say hi\nOutput token limit hit. Resume."}])
    reused = eng.complete(b, greedy)
    start = eng.message_starts(b)[-1]  # where the edited message starts
    assert reused.cached_tokens == start > len(a) // 2
    eng.drop_held()
    assert eng.complete(b, greedy).token_ids == reused.token_ids


def test_launch_plans():
    claude = plan("claude", "http://127.0.0.1:8080", "m", 8192, 512, "k")
    assert claude.env["ANTHROPIC_BASE_URL"] == "http://127.0.0.1:8080" and claude.env["ANTHROPIC_MODEL"] == "m"
    assert claude.env["CLAUDE_CODE_ATTRIBUTION_HEADER"] == "0"
    assert claude.env["CLAUDE_CODE_AUTO_COMPACT_WINDOW"] == "8192"
    codex = plan("codex", "http://h:1", "m", 8192, 512, "k")
    joined = " ".join(codex.args)
    assert 'model_providers.ninfer.wire_api="responses"' in joined and 'base_url="http://h:1/v1"' in joined
    assert "model_context_window=8192" in joined
    oc = plan("opencode", "http://h:1", "m", 8192, 512, "k")
    cfg = json.loads(next(iter(oc.files.values())))
    assert cfg["provider"]["ninfer"]["options"]["baseURL"] == "http://h:1/v1" and cfg["model"] == "ninfer/m"
    aider = plan("aider", "http://h:1", "m", 8192, 512, "k")
    assert aider.env["OPENAI_API_BASE"] == "http://h:1/v1" and aider.args[:2] == ["--model", "openai/m"]


def test_launch_with_a_stand_in_client(tmp_path):
    fake = tmp_path / "bin" / "claude"
    fake.parent.mkdir()
    fake.write_text(f"#!{sys.executable}\nimport json, os, sys\nprint(json.dumps({{'argv': sys.argv[1:], "
                    "'env': {k: v for k, v in os.environ.items() if k.startswith(('ANTHROPIC', 'CLAUDE'))}}))\n")
    fake.chmod(0o755)
    env = {"PATH": f"{fake.parent}{os.pathsep}{os.environ['PATH']}"}
    try:
        r = run_cli("launch", "claude", "--", "-p", "hello", env=env)
        assert r.returncode == 0, r.stderr
        out = json.loads(r.stdout.strip().splitlines()[-1])
        assert out["argv"] == ["-p", "hello"] and out["env"]["ANTHROPIC_MODEL"] == MODEL
        assert out["env"]["ANTHROPIC_BASE_URL"].startswith("http://127.0.0.1:")
        assert "CLAUDE_CODE_ATTRIBUTION_HEADER=0" in r.stderr  # printed what it set
        again = run_cli("launch", "claude", "--", "-p", "again", env=env)
        assert "using the running ninfer server" in again.stderr  # reused, not a second model
    finally:
        run_cli("stop", "--all")
    r = run_cli("launch", "aider", env={"PATH": str(tmp_path / "empty")})
    assert r.returncode == 2 and "install it" in r.stderr


# ---- the real clients ------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def npm_clients(tmp_path_factory):
    """The three npm clients, installed under this run's temporary dirs (npm's cache too: conftest points it
    there), never into the user's."""
    if shutil.which("npm") is None:
        pytest.skip("npm is not installed, so the clients cannot be installed")
    prefix = tmp_path_factory.mktemp("npm")
    r = subprocess.run(["npm", "install", "--no-audit", "--no-fund", "--prefix", str(prefix),
                        "@anthropic-ai/claude-code", "@openai/codex", "opencode-ai"], capture_output=True, text=True,
                       timeout=900)
    if r.returncode != 0:
        pytest.skip(f"the npm registry is unreachable: {r.stderr.strip().splitlines()[-1:]}")
    return prefix / "node_modules" / ".bin"


def _server_log() -> str:
    logs = Path(os.environ["NINFER_STATE_DIR"]) / "logs"
    return "\n".join(p.read_text(errors="replace") for p in logs.glob("*.log"))


def _cached(log: str, route: str) -> list[int]:
    return [int(line.split("(")[1].split(" cached")[0]) for line in log.splitlines()
            if f"ninfer.server: {route}:" in line]


def _completed(r) -> bool:
    """The client finished its turn: a model that writes until its token budget is not a protocol error."""
    return r.returncode == 0 or "max_output_tokens" in r.stdout + r.stderr


@pytest.mark.slow
def test_real_codex_cli(npm_clients, tiny_qwen, tmp_path):
    profile = long_context_profile(tiny_qwen)
    env = {"PATH": f"{npm_clients}{os.pathsep}{os.environ['PATH']}", "CODEX_HOME": str(tmp_path / "codex")}
    (tmp_path / "codex").mkdir()
    try:
        r = run_cli("launch", "codex", "--profile", profile, "--", "exec", "--skip-git-repo-check", "say hi",
                    env=env, timeout=600)
        assert _completed(r), r.stdout + r.stderr
        again = run_cli("launch", "codex", "--profile", profile, "--", "exec", "--skip-git-repo-check", "resume",
                        "--last", "and again", env=env, timeout=600)
        assert _completed(again), again.stdout + again.stderr
        assert "POST /v1/responses" in _server_log() and " 500 " not in _server_log()
        cached = _cached(_server_log(), "responses")
        assert len(cached) >= 2 and cached[-1] > 0, cached
    finally:
        run_cli("stop", "--all")


@pytest.fixture(scope="module")
def tiny_qwen(tmp_path_factory) -> Path:
    """Agent system prompts run to ~18K tokens (codex's to ~6K): a tiny random model with the real Qwen vocabulary
    and a long context holds them on a CPU, where the default model would take minutes a request."""
    folder = write_tiny(tmp_path_factory.mktemp("tinyq") / "tinyq", max_position_embeddings=262144,
                        vocab_size=248320, eos_token_id=248046)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        (folder / name).unlink(missing_ok=True)  # the Qwen3.5 vocabulary and template from ninfer
    return folder


def long_context_profile(folder: Path) -> str:
    """A profile (in this test's config dir) serving `folder` with a long context and short greedy replies."""
    profiles_dir = Path(os.environ["NINFER_CONFIG_DIR"]) / "profiles"
    profiles_dir.mkdir(parents=True, exist_ok=True)
    (profiles_dir / "tq.toml").write_text(f'model = "{folder}"\nmax_context = 200000\n'
                                          '[sampling]\nmax_tokens = 24\ntemperature = 0.0\n')
    return "tq"


@pytest.mark.slow
def test_real_opencode(npm_clients, tiny_qwen, tmp_path):
    profile = long_context_profile(tiny_qwen)
    env = {"PATH": f"{npm_clients}{os.pathsep}{os.environ['PATH']}", "HOME": str(tmp_path)}
    try:
        r = run_cli("launch", "opencode", "--profile", profile, "--", "run", "say hi", env=env, timeout=600)
        again = run_cli("launch", "opencode", "--profile", profile, "--", "run", "--continue", "and again",
                        env=env, timeout=600)
        log = _server_log()
        assert "POST /v1/chat/completions" in log, r.stdout + r.stderr + again.stdout + again.stderr
        cached = _cached(log, "chat.completions")
        assert len(cached) >= 3 and max(cached) > 0, cached
    finally:
        run_cli("stop", "--all")


@pytest.mark.slow
def test_real_claude_code(npm_clients, tiny_qwen, tmp_path):
    profile = long_context_profile(tiny_qwen)
    env = {"PATH": f"{npm_clients}{os.pathsep}{os.environ['PATH']}", "HOME": str(tmp_path)}
    try:
        r = run_cli("launch", "claude", "--profile", profile, "--", "-p", "say hi", "--max-turns", "1", env=env,
                    timeout=600)
        log = _server_log()
        assert "POST /v1/messages?beta=true" in log and "500" not in log.split("POST")[-1], r.stdout + r.stderr
        cached = _cached(log, "messages")
        assert len(cached) >= 2 and max(cached) > 0, cached
    finally:
        run_cli("stop", "--all")


@pytest.fixture(scope="module")
def aider_bin(tmp_path_factory):
    """aider in a virtual environment of its own under this run's temporary dirs, not the project's."""
    venv = tmp_path_factory.mktemp("aider") / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    # --no-compile: aider imports a small part of its dependencies, compiled as it does
    r = subprocess.run([str(venv / "bin" / "pip"), "install", "-q", "--no-compile", "aider-chat"], capture_output=True,
                       text=True, timeout=900)
    if r.returncode != 0:
        pytest.skip(f"PyPI is unreachable for aider-chat: {r.stderr.strip().splitlines()[-1:]}")
    return venv / "bin"


@pytest.mark.slow
def test_real_aider(aider_bin, tiny_qwen, tmp_path):
    profile = long_context_profile(tiny_qwen)
    work = tmp_path / "work"
    work.mkdir()
    env = {"PATH": f"{aider_bin}{os.pathsep}{os.environ['PATH']}", "HOME": str(tmp_path)}
    flags = ["--yes-always", "--no-git", "--no-check-update", "--no-show-model-warnings", "--no-analytics"]
    try:
        first = subprocess.run([sys.executable, "-m", "ninfer_tui.cli", "launch", "aider", "--profile", profile, "--",
                                "--message", "say hi", *flags], cwd=work, env={**os.environ, **env},
                               capture_output=True, text=True, timeout=600)
        second = subprocess.run([sys.executable, "-m", "ninfer_tui.cli", "launch", "aider", "--profile", profile,
                                 "--", "--restore-chat-history", "--message", "and again", *flags], cwd=work,
                                env={**os.environ, **env}, capture_output=True, text=True, timeout=600)
        log = _server_log()
        assert "POST /v1/chat/completions" in log, first.stdout + first.stderr + second.stderr
        cached = _cached(log, "chat.completions")
        # the second run's own output says why it sent no request, if it did not
        assert len(cached) >= 2 and max(cached) > 0, (cached, second.returncode, second.stdout[-2000:],
                                                      second.stderr[-2000:])
    finally:
        run_cli("stop", "--all")
