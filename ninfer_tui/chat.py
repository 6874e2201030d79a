"""`ninfer chat`: a line-mode chat for plain terminals (prompt_toolkit), and a pipe mode for scripts."""
from __future__ import annotations

import argparse
import dataclasses
import sys

from engine import Engine, FinishEvent, SamplingParams, TokenEvent

from .launch import engine_from_profile, profile_from_args, sampling_from_args

HELP = "commands: /new (start over), /clear (same), /exit; Ctrl+D quits"


def reply(engine: Engine, messages: list[dict], params: SamplingParams, out=sys.stdout) -> FinishEvent:
    """Stream the assistant's answer to `out` and return the finish event."""
    ids = engine.encode_chat(messages)
    max_tokens = min(params.max_tokens, engine.max_context - len(ids))
    final = None
    run = dataclasses.replace(params, max_tokens=max(max_tokens, 1))
    for event in engine.generate(ids, run):
        if isinstance(event, TokenEvent):
            out.write(event.text)
            out.flush()
        else:
            final = event
    out.write("\n")
    return final


def _start(system: str | None) -> list[dict]:
    return [{"role": "system", "content": system}] if system else []


def run_chat(args: argparse.Namespace) -> int:
    profile = profile_from_args(args)
    params = sampling_from_args(args, profile)
    interactive = sys.stdin.isatty()
    engine = engine_from_profile(profile)
    messages = _start(args.system)
    if not interactive:
        prompt = sys.stdin.read().strip()
        if not prompt:
            print("error: no prompt on stdin", file=sys.stderr)
            return 2
        messages.append({"role": "user", "content": prompt})
        reply(engine, messages, params)
        return 0

    from prompt_toolkit import PromptSession
    from prompt_toolkit.history import FileHistory

    from . import paths

    session = PromptSession(history=FileHistory(str(paths.state_dir() / "chat_history")))
    print(f"chatting with {engine.model_name} — {HELP}", file=sys.stderr)
    while True:
        try:
            line = session.prompt(">>> ")
        except (EOFError, KeyboardInterrupt):
            return 0
        text = line.strip()
        if not text:
            continue
        if text in ("/exit", "/quit"):
            return 0
        if text in ("/new", "/clear"):
            messages = _start(args.system)
            print("(new conversation)", file=sys.stderr)
            continue
        if text.startswith("/"):
            print(HELP, file=sys.stderr)
            continue
        messages.append({"role": "user", "content": line})
        try:
            final = reply(engine, messages, params)
        except KeyboardInterrupt:
            print("\n(stopped)", file=sys.stderr)
            messages.pop()
            continue
        messages.append({"role": "assistant", "content": final.text})
