"""`ninfer` command line: argparse, one small module per subcommand."""
from __future__ import annotations

import argparse
import json
import os
import sys
import traceback

from engine.errors import NinferError, UserError

from . import __version__, diagnose_cmd, profiles_cmd, serve_cmd
from .launch import add_engine_args, add_sampling_args


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="ninfer", description="Chat with and serve local LLMs. With no command: chat in the terminal.")
    parser.add_argument("--version", action="version", version=f"ninfer {__version__}")
    parser.add_argument("--profile", "-P", help="with no command: the profile the app starts with")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    g = sub.add_parser("generate", help="generate a completion for one prompt")
    src = g.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", "-p", help="raw prompt text")
    src.add_argument("--prompt-ids", help="comma-separated prompt token ids")
    src.add_argument("--chat", help="a user message, wrapped in the model's chat template")
    add_engine_args(g)
    add_sampling_args(g)
    g.add_argument("--json", action="store_true", help="print one JSON object instead of streaming text")

    c = sub.add_parser("chat", help="line-mode chat (reads one prompt from stdin when it is not a terminal)")
    add_engine_args(c)
    add_sampling_args(c)
    c.add_argument("--system", help="system prompt")
    c.add_argument("--session", help="continue a saved session (id or title)")
    c.add_argument("--new", action="store_true", help="start a new session (the default)")

    pl = sub.add_parser("pull", help="download a registry model into the cache")
    pl.add_argument("name", nargs="?", default=None, help="model name (default: smollm2-135m)")

    ms = sub.add_parser("models", help="list registry models and whether they are pulled")
    ms.add_argument("--json", action="store_true")

    profiles_cmd.add_parser(sub)
    serve_cmd.add_parsers(sub)
    diagnose_cmd.add_parsers(sub)
    la = sub.add_parser("launch", help="run a coding-agent client (claude, codex, opencode, aider) against ninfer")
    la.add_argument("client", choices=["claude", "codex", "opencode", "aider"])
    la.add_argument("--profile", "-P")
    la.epilog = "Arguments after -- go to the client, e.g. ninfer launch codex -- exec 'fix the tests'"
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    cut = argv.index("--") if "--" in argv else len(argv)  # what follows -- belongs to a launched client
    args = build_parser().parse_args(argv[:cut])
    args.argv, args.client_args = argv, argv[cut + 1:]
    try:
        return _dispatch(args)
    except NinferError as exc:
        print(f"error: {exc}", file=sys.stderr)
        if exc.hint:
            print(f"hint: {exc.hint}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except Exception as exc:  # an internal bug: one line, traceback only on request
        if os.environ.get("NINFER_DEBUG"):
            traceback.print_exc()
        print(f"internal error: {type(exc).__name__}: {exc} (set NINFER_DEBUG=1 for the traceback)", file=sys.stderr)
        return 1


def _dispatch(args: argparse.Namespace) -> int:
    command = args.command or "chat"
    if command == "generate":
        from .generate_cmd import run_generate

        return run_generate(args)
    if command == "chat":
        if args.command is None:
            if sys.stdin.isatty() and sys.stdout.isatty():  # bare `ninfer` in a terminal: the app
                from .app.app import run_app

                return run_app(args.profile)
            args = build_parser().parse_args(["chat", *(["--profile", args.profile] if args.profile else [])])
        from .chat import run_chat

        return run_chat(args)
    if command == "pull":
        from .models import DEFAULT_MODEL, pull

        print(pull(args.name or DEFAULT_MODEL))
        return 0
    if command == "serve":
        return serve_cmd.run_serve(args)
    if command == "ps":
        return serve_cmd.run_ps(args)
    if command == "stop":
        return serve_cmd.run_stop(args)
    if command == "launch":
        from .agents import run_launch

        return run_launch(args)
    if command == "speedcheck":
        return diagnose_cmd.run_speedcheck_cmd(args)
    if command == "doctor":
        return diagnose_cmd.run_doctor(args)
    if command == "gpu-clean":
        return diagnose_cmd.run_gpu_clean(args)
    if command == "profiles":
        return profiles_cmd.run(args)
    if command == "models":
        from .models import list_models

        rows = list_models()
        if args.json:
            print(json.dumps(rows, indent=2))
        else:
            for r in rows:
                state = "pulled" if r["pulled"] else "not pulled"
                print(f"{r['name']:16s} {state:11s} {r['description']}")
        return 0
    raise UserError(f"unknown command {command!r}")


if __name__ == "__main__":
    sys.exit(main())
