"""`ninfer launch CLIENT`: start (or reuse) the background server for a profile, then run a coding-agent client
configured for it, printing every setting it made."""
from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
from dataclasses import dataclass, field

from engine.errors import UserError

from . import paths, profiles

CLIENTS = {
    "claude": ("claude", "npm install -g @anthropic-ai/claude-code"),
    "codex": ("codex", "npm install -g @openai/codex"),
    "opencode": ("opencode", "npm install -g opencode-ai"),
    "aider": ("aider", "pipx install aider-chat  (or: pip install aider-chat)"),
}


@dataclass
class Launch:
    program: str
    env: dict[str, str] = field(default_factory=dict)
    args: list[str] = field(default_factory=list)
    files: dict[str, str] = field(default_factory=dict)  # path -> content written before the start


def plan(client: str, url: str, model: str, max_context: int, max_output: int, api_key: str) -> Launch:
    """What to set for each client so it talks to ninfer (pure: testable without the clients)."""
    v1 = f"{url}/v1"
    if client == "claude":
        return Launch("claude", env={
            "ANTHROPIC_BASE_URL": url, "ANTHROPIC_API_KEY": api_key, "ANTHROPIC_MODEL": model,
            "ANTHROPIC_DEFAULT_OPUS_MODEL": model, "ANTHROPIC_DEFAULT_SONNET_MODEL": model,
            "ANTHROPIC_DEFAULT_HAIKU_MODEL": model, "CLAUDE_CODE_SUBAGENT_MODEL": model,
            # the per-request attribution line would change the prompt's first tokens on every request
            "CLAUDE_CODE_ATTRIBUTION_HEADER": "0",
            "CLAUDE_CODE_AUTO_COMPACT_WINDOW": str(max_context),
            "CLAUDE_CODE_MAX_OUTPUT_TOKENS": str(max_output),
            "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
        })
    if client == "codex":
        overrides = {
            "model_provider": "ninfer", "model": model, "model_providers.ninfer.name": "ninfer",
            "model_providers.ninfer.base_url": v1, "model_providers.ninfer.env_key": "NINFER_API_KEY",
            "model_providers.ninfer.wire_api": "responses", "model_context_window": max_context,
            "model_auto_compact_token_limit": int(max_context * 0.9),
        }
        args = []
        for key, value in overrides.items():
            args += ["-c", f"{key}={json.dumps(value)}"]
        return Launch("codex", env={"NINFER_API_KEY": api_key}, args=args)
    if client == "opencode":
        config = paths.state_dir() / "opencode.json"
        content = json.dumps({
            "$schema": "https://opencode.ai/config.json",
            "provider": {"ninfer": {"npm": "@ai-sdk/openai-compatible", "name": "ninfer",
                                    "options": {"baseURL": v1, "apiKey": api_key},
                                    "models": {model: {"name": model, "limit": {"context": max_context,
                                                                                "output": max_output}}}}},
            "model": f"ninfer/{model}",
        }, indent=2)
        return Launch("opencode", env={"OPENCODE_CONFIG": str(config)}, files={str(config): content})
    if client == "aider":
        meta = paths.state_dir() / "aider-model-metadata.json"
        content = json.dumps({f"openai/{model}": {"max_input_tokens": max_context, "max_output_tokens": max_output,
                                                  "litellm_provider": "openai", "mode": "chat"}})
        return Launch("aider", env={"OPENAI_API_BASE": v1, "OPENAI_API_KEY": api_key},
                      args=["--model", f"openai/{model}", "--model-metadata-file", str(meta)],
                      files={str(meta): content})
    raise UserError(f"unknown client {client!r}", hint="clients: " + ", ".join(CLIENTS))


def ensure_server(profile_name: str | None) -> tuple[str, str, profiles.Profile]:
    """(url, model id) of a ready server for the profile: a running one, or one started now in the background."""
    from engine.server.lifecycle import health, list_servers

    from .serve_cmd import check_port, run_dir

    profile = profiles.select(profile_name, announce=lambda m: print(m, file=sys.stderr))
    for s in list_servers(run_dir()):
        if s.profile == profile.name and (health(s.url, 1.0) or {}).get("status") == "ready":
            print(f"using the running ninfer server {s.url} (pid {s.pid}, profile {s.profile})", file=sys.stderr)
            return s.url, s.model, profile
    port = profile.port
    try:
        check_port(profile.host, port)
    except UserError:  # the profile's port is taken by something else: any free one will do for the client
        with socket.socket() as sock:
            sock.bind((profile.host, 0))
            port = sock.getsockname()[1]
    proc = subprocess.run([sys.executable, "-m", "ninfer_tui.cli", "serve", "--detach", "--profile", profile.name,
                           "--port", str(port)], stdout=subprocess.PIPE, text=True)
    if proc.returncode != 0:
        raise UserError(f"the server for profile {profile.name} did not start",
                        hint="see the log above; `ninfer serve --profile NAME` runs it in the foreground")
    for s in list_servers(run_dir()):
        if s.profile == profile.name:
            return s.url, s.model, profile
    raise UserError("the server started but left no pidfile", hint="`ninfer ps` lists running servers")


def run_launch(args: argparse.Namespace) -> int:
    program, install = CLIENTS[args.client]
    if shutil.which(program) is None:
        raise UserError(f"{program} is not installed (or not on PATH)", hint=f"install it: {install}")
    url, model, profile = ensure_server(args.profile)
    api_key = os.environ.get("NINFER_API_KEY") or "ninfer-local"
    launch = plan(args.client, url, model, profile.max_context, profile.sampling.max_tokens, api_key)
    for path, content in launch.files.items():
        with open(path, "w", encoding="utf-8") as f:
            f.write(content)
        print(f"wrote {path}", file=sys.stderr)
    for key, value in launch.env.items():
        shown = "(set)" if "KEY" in key and value != "ninfer-local" else value
        print(f"{key}={shown}", file=sys.stderr)
    cmd = [launch.program, *launch.args, *args.client_args]
    print("running: " + " ".join(cmd), file=sys.stderr)
    return subprocess.call(cmd, env={**os.environ, **launch.env})
