"""`ninfer chat`: a line-mode chat for plain terminals (prompt_toolkit), and a pipe mode for scripts.
Conversations are saved in the same session store as the TUI's."""
from __future__ import annotations

import argparse
import sys

from engine import SamplingParams
from engine.errors import UserError

from .chat_client import LocalClient, ReplyEvent
from .launch import engine_from_profile, profile_from_args, sampling_from_args
from .sessions import Session, SessionStore

HELP = ("commands: /new, /sessions, /open ID|TITLE, /profile NAME, /clear, /exit; Ctrl+D quits; "
        "Alt+Enter (or Esc then Enter) adds a line")


def stream_reply(client, messages: list[dict], params: SamplingParams, out=sys.stdout) -> tuple[str, ReplyEvent]:
    """Print the answer as it streams (reasoning dimmed on a terminal); returns (text, final event)."""
    parts, final, shown_reasoning = [], None, False
    for ev in client.reply(messages, params):
        if ev.kind == "text":
            if shown_reasoning:
                out.write("\n")
                shown_reasoning = False
            parts.append(ev.text)
            out.write(ev.text)
        elif ev.kind == "reasoning" and out.isatty():
            out.write(f"\x1b[2m{ev.text}\x1b[0m")
            shown_reasoning = True
        elif ev.kind == "done":
            final = ev
        out.flush()
    out.write("\n")
    return "".join(parts), final


class LineChat:
    def __init__(self, args: argparse.Namespace, store: SessionStore | None) -> None:
        self.args, self.store = args, store
        self.profile = profile_from_args(args)
        self.params = sampling_from_args(args, self.profile)
        self.client = LocalClient(engine_from_profile(self.profile), self.profile.name)
        self.session: Session | None = None
        self.messages: list[dict] = []

    def _system(self) -> list[dict]:
        return [{"role": "system", "content": self.args.system}] if self.args.system else []

    def new(self) -> None:
        self.session, self.messages = None, self._system()

    def open(self, ref: str) -> None:
        s = self.store.find(ref)
        if s is None:
            raise UserError(f"no session {ref!r}", hint="/sessions lists them")
        self.session = s
        self.messages = self._system() + [m.as_chat() for m in self.store.messages(s.id)]
        for m in self.messages[-4:]:
            print(f"[{m['role']}] {m['content']}", file=sys.stderr)

    def send(self, text: str) -> None:
        if self.store is not None and self.session is None:
            self.session = self.store.create(model=self.profile.model, profile=self.profile.name)
        self.messages.append({"role": "user", "content": text})
        if self.store is not None:
            self.store.add(self.session.id, "user", text)
        try:
            reply, final = stream_reply(self.client, self.messages, self.params)
        except KeyboardInterrupt:
            print("\n(stopped)", file=sys.stderr)
            self.messages.pop()
            return
        self.messages.append({"role": "assistant", "content": reply})
        if self.store is not None:
            self.store.add(self.session.id, "assistant", reply, tokens=final.completion_tokens if final else 0)

    def command(self, line: str) -> bool:
        """Run a slash command; False means exit."""
        cmd, _, rest = line.partition(" ")
        rest = rest.strip()
        if cmd in ("/exit", "/quit"):
            return False
        if cmd in ("/new", "/clear"):
            self.new()
            print("(new conversation)", file=sys.stderr)
        elif cmd == "/sessions":
            for s in self.store.list(rest)[:20]:
                print(f"{s.id:5d}  {s.title}  ({s.profile})", file=sys.stderr)
        elif cmd == "/open" and rest:
            self.open(rest)
        elif cmd == "/profile" and rest:
            self.args.profile = rest
            self.__init__(self.args, self.store)
            print(f"(profile {self.profile.name}: {self.client.label})", file=sys.stderr)
        else:
            print(HELP, file=sys.stderr)
        return True


def run_chat(args: argparse.Namespace) -> int:
    interactive = sys.stdin.isatty()
    if not interactive:
        prompt = sys.stdin.read().strip()
        if not prompt:
            raise UserError("no prompt on stdin", hint="pipe some text in, e.g. echo 'Hi' | ninfer")
        store = SessionStore() if args.session else None
        chat = LineChat(args, store)
        if args.session:
            chat.open(args.session) if store.find(args.session) else chat.new()
        else:
            chat.new()
        chat.send(prompt)
        return 0
    from prompt_toolkit import PromptSession
    from prompt_toolkit.history import FileHistory

    from . import paths

    store = SessionStore()
    chat = LineChat(args, store)
    chat.new()
    if args.session and not args.new:
        chat.open(args.session)
    prompt = PromptSession(history=FileHistory(str(paths.state_dir() / "chat_history")), multiline=True,
                           key_bindings=_keys(), prompt_continuation="... ")
    print(f"chatting with {chat.client.label} (profile {chat.profile.name}) — {HELP}", file=sys.stderr)
    return loop(chat, prompt)


def _keys():
    """Enter sends; Esc then Enter (Alt+Enter in most terminals) or Ctrl+J adds a line."""
    from prompt_toolkit.key_binding import KeyBindings

    kb = KeyBindings()

    @kb.add("enter")
    def _send(event) -> None:
        event.current_buffer.validate_and_handle()

    @kb.add("escape", "enter")
    @kb.add("c-j")
    def _newline(event) -> None:
        event.current_buffer.insert_text("\n")

    return kb


def loop(chat: LineChat, prompt) -> int:
    while True:
        try:
            line = prompt.prompt(">>> ")
        except (EOFError, KeyboardInterrupt):
            return 0
        text = line.strip()
        if not text:
            continue
        if text.startswith("/"):
            try:
                if not chat.command(text):
                    return 0
            except UserError as exc:
                print(f"error: {exc}" + (f" ({exc.hint})" if exc.hint else ""), file=sys.stderr)
            continue
        chat.send(line)
