"""`ninfer` command line: argparse, one small module per subcommand. Heavy packages (torch, Textual, the server)
are imported by the command that needs them, so every other command answers at once."""
from __future__ import annotations

import argparse
import difflib
import json
import os
import re
import sys
import traceback
from typing import NoReturn

from engine.errors import NinferError, UserError

from . import __version__, convert_cmd, diagnose_cmd, profiles_cmd, serve_cmd
from .launch import add_engine_args, add_sampling_args


class Parser(argparse.ArgumentParser):
    """argparse with ninfer's error shape (`error:` and `hint:` lines, exit 2) and "did you mean" for a mistyped
    command, choice or flag."""

    def parse_args(self, args=None, namespace=None):
        ns, extras = self.parse_known_args(args, namespace)
        if extras:  # name the subcommand whose flags were meant, so the suggestion comes from its own
            _innermost(self, ns).error("unrecognized arguments: " + " ".join(extras))
        return ns

    def error(self, message: str) -> NoReturn:
        print(f"error: {self.prog}: {message}", file=sys.stderr)
        close = self._suggestion(message)
        print(f"hint: did you mean {close}?" if close else f"hint: see `{self.prog} --help`", file=sys.stderr)
        sys.exit(2)

    def _suggestion(self, message: str) -> str | None:
        choice = re.search(r"invalid choice: '([^']*)'", message)
        if choice:
            known = [str(c) for a in self._actions if a.choices for c in a.choices]
            close = difflib.get_close_matches(choice.group(1), known, n=1)
            return close[0] if close else None
        if message.startswith("unrecognized arguments: "):
            flags = [s for a in self._actions for s in a.option_strings if s.startswith("--")]
            for word in message.removeprefix("unrecognized arguments: ").split():
                close = difflib.get_close_matches(word.split("=")[0], flags, n=1) if word.startswith("--") else []
                if close:
                    return close[0]
        return None


def _innermost(parser: argparse.ArgumentParser, ns: argparse.Namespace) -> argparse.ArgumentParser:
    """The (sub)parser that parsed the last subcommand named on the command line."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction) and getattr(ns, action.dest, None) in action.choices:
            return _innermost(action.choices[getattr(ns, action.dest)], ns)
    return parser


def add_chat_args(p, model: bool = True) -> None:
    """What a chat takes: the engine, the sampling and the conversation."""
    add_engine_args(p, model=model)
    add_sampling_args(p)
    p.add_argument("--system", help="system prompt")
    p.add_argument("--session", help="continue a saved session (id or title)")
    p.add_argument("--new", action="store_true", help="start a new session (the default)")
    p.add_argument("--verbose", action="store_true",
                   help="after each reply, print its token counts and prompt and eval rates (as ollama's --verbose)")


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="ninfer", usage="ninfer [FLAGS] [COMMAND ...]",
                    description="Chat with and serve local LLMs. With no command: the app in a terminal, or one "
                    "reply to a prompt piped in (echo hi | ninfer -n 64).")
    parser.add_argument("--version", action="version", version=f"ninfer {__version__}")
    add_chat_args(parser.add_argument_group("with no command: the app takes --profile; a piped prompt takes all"))
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", prog="ninfer")

    r = sub.add_parser("run", help="chat with a model, pulling it first if needed (one reply with a prompt "
                       "argument or piped input)")
    r.add_argument("model", metavar="MODEL", help="registry name (see `ninfer models`), .gguf file or HF folder")
    r.add_argument("words", nargs="*", metavar="PROMPT", help="a prompt: reply to it once, then exit")
    add_chat_args(r, model=False)

    g = sub.add_parser("generate", help="generate a completion for one prompt")
    src = g.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", "-p", help="raw prompt text")
    src.add_argument("--prompt-ids", help="comma-separated prompt token ids")
    src.add_argument("--chat", help="a user message, wrapped in the model's chat template")
    g.add_argument("--image", action="append", default=[], metavar="PATH",
                   help="an image before the --chat message (repeatable; a vision-language model)")
    g.add_argument("--video", action="append", default=[], metavar="PATH",
                   help="a video (MP4/MOV, WebM/MKV, AVI) before the --chat message, after its images (repeatable; "
                   "a vision-language model)")
    add_engine_args(g)
    add_sampling_args(g)
    g.add_argument("--json", action="store_true", help="print one JSON object instead of streaming text")

    c = sub.add_parser("chat", help="line-mode chat (reads one prompt from stdin when it is not a terminal)")
    add_chat_args(c)

    pl = sub.add_parser("pull", help="download a registry model into the cache (every file hash checked; an "
                        "interrupted pull resumes) and print its path")
    pl.add_argument("name", nargs="?", default=None, help="model name (default: smollm2-135m)")
    pl.add_argument("--offline", action="store_true",
                    help="never touch the network: check the cached files against their hashes (HF_HUB_OFFLINE=1 "
                    "does the same for hub models)")

    ms = sub.add_parser("models", help="list registry models and whether they are pulled")
    ms.add_argument("--json", action="store_true", help="print the list as JSON")

    sh = sub.add_parser("show", help="a model's architecture, size, context, quantization, template and license "
                        "(read from its file, without loading it)")
    sh.add_argument("model", metavar="MODEL", help="registry name, .gguf file or HF folder")
    sh.add_argument("--json", action="store_true", help="print one JSON object")

    rm = sub.add_parser("rm", help="remove a pulled model from the cache")
    rm.add_argument("model", metavar="MODEL", help="registry name (see `ninfer models`)")

    convert_cmd.add_parser(sub)
    profiles_cmd.add_parser(sub)
    serve_cmd.add_parsers(sub)
    diagnose_cmd.add_parsers(sub)
    la = sub.add_parser("launch", help="run a coding-agent client (claude, codex, opencode, aider) against ninfer")
    la.add_argument("client", choices=["claude", "codex", "opencode", "aider"], help="the client to run")
    la.add_argument("--profile", "-P", help="the profile of the server it talks to (default: the default profile)")
    la.epilog = "Arguments after -- go to the client, e.g. ninfer launch codex -- exec 'fix the tests'"
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    cut = argv.index("--") if "--" in argv else len(argv)  # what follows -- belongs to a launched client
    parser = build_parser()
    args = parser.parse_args(argv[:cut])
    args.argv, args.client_args = argv, argv[cut + 1:]
    try:
        return _dispatch(args, parser)
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


def _dispatch(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    command = args.command or "chat"
    if command == "generate":
        from .generate_cmd import run_generate

        return run_generate(args)
    if command == "chat":
        if args.command is None and sys.stdin.isatty() and sys.stdout.isatty():  # bare `ninfer` in a terminal
            _app_flags_only(args, parser)
            from .app.app import run_app

            return run_app(args.profile)
        from .chat import run_chat

        return run_chat(args)
    if command == "run":
        from .chat import run_chat

        args.prompt = " ".join(args.words) or None
        return run_chat(args)
    if command == "pull":
        from .models import DEFAULT_MODEL, pull

        print(pull(args.name or DEFAULT_MODEL, offline=args.offline))
        return 0
    if command == "convert":
        return convert_cmd.run(args)
    if command == "show":
        from .model_info import describe

        info = describe(args.model)
        print(json.dumps(info.as_dict(), indent=2) if args.json else info.render())
        return 0
    if command == "rm":
        return _rm(args.model)
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
            width = max(len(r["name"]) for r in rows)
            for r in rows:
                state = "pulled" if r["pulled"] else "not pulled"
                print(f"{r['name']:{width}s} {state:11s} {r['description']}")
        return 0
    raise UserError(f"unknown command {command!r}")


def _app_flags_only(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    """The app starts from a profile alone; chat flags given to it would be silently ignored, so they are refused."""
    given = [a.option_strings[0] for a in parser._actions
             if a.option_strings and a.dest not in ("profile", "help", "version")
             and getattr(args, a.dest, a.default) != a.default]
    if given:
        raise UserError(f"the app (`ninfer` in a terminal) takes only --profile, not {', '.join(given)}",
                        hint="for a chat with these flags use `ninfer chat ...`, or pipe a prompt in: "
                        f"echo 'Hi' | ninfer {' '.join(given)} ...")


def _rm(ref: str) -> int:
    from .model_info import size_text
    from .models import remove

    name, folder, freed = remove(ref)
    print(f"removed {name}: {size_text(freed)} freed ({folder})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
