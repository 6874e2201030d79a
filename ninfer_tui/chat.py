"""`ninfer chat`: a line-mode chat for plain terminals (prompt_toolkit), and a pipe mode for scripts.
Conversations are saved in the same session store as the TUI's, piped ones included; a reply is saved as it
streams (marked interrupted until it finishes), so a killed chat leaves its session whole."""
from __future__ import annotations

import argparse
import contextlib
import signal
import sys
import threading
from collections.abc import Iterator

from engine.errors import UserError

from .attachments import read_image, with_images
from .chat_client import LocalClient, ReplyEvent
from .launch import engine_from_profile, profile_from_args, sampling_from_args
from .sessions import Session, SessionStore, StreamedReply

HELP = ("commands: /new, /sessions, /open ID|TITLE, /profile NAME, /image PATH, /video PATH, /clear, /exit; Ctrl+D "
        "quits; Alt+Enter (or Esc then Enter) adds a line")
SHOWN_ON_OPEN = 4  # messages of an opened session shown again


@contextlib.contextmanager
def quiet_keys(stream) -> Iterator[None]:
    """While a reply streams to a terminal: keys typed meanwhile are not echoed into it, and are dropped when it
    ends (the next prompt starts empty). The terminal is restored however the reply ends: done, Ctrl+C (which
    still interrupts), an error, or SIGTERM (turned into an exit so that this restore runs)."""
    try:
        fd = stream.fileno()
    except (AttributeError, OSError, ValueError):
        fd = -1
    if fd < 0 or not stream.isatty():
        yield
        return
    import termios

    saved = termios.tcgetattr(fd)
    quiet = list(saved)
    quiet[3] &= ~termios.ECHO  # the local modes; canonical input and Ctrl+C's signal stay as they were
    on_main = threading.current_thread() is threading.main_thread()  # where Python allows a signal handler
    on_term = signal.signal(signal.SIGTERM, _exit_on_sigterm) if on_main else None
    try:
        termios.tcsetattr(fd, termios.TCSANOW, quiet)
        yield
    finally:
        try:
            with contextlib.suppress(termios.error):  # a terminal gone meanwhile (hung up) has nothing to restore
                termios.tcsetattr(fd, termios.TCSAFLUSH, saved)  # TCSAFLUSH: what was typed meanwhile is discarded
        finally:
            if on_main:  # None: the handler before was not Python's; the default is the nearest to it
                signal.signal(signal.SIGTERM, signal.SIG_DFL if on_term is None else on_term)


def _exit_on_sigterm(signum, frame) -> None:
    raise SystemExit(128 + signum)


def _duration(seconds: float) -> str:
    return f"{seconds * 1000:.2f}ms" if seconds < 1 else f"{seconds:.3f}s"


def verbose_stats(final: ReplyEvent) -> str:
    """ollama's `--verbose` lines for one reply."""
    cached = f" (+{final.cached_tokens} cached)" if final.cached_tokens else ""
    prompt_rate = final.prompt_eval_tokens / final.prompt_eval_s if final.prompt_eval_s > 0 else 0.0
    rows = [("total duration", _duration(final.total_s)),
            ("prompt eval count", f"{final.prompt_eval_tokens} token(s){cached}"),
            ("prompt eval duration", _duration(final.prompt_eval_s)),
            ("prompt eval rate", f"{prompt_rate:.2f} tokens/s"),
            ("eval count", f"{final.completion_tokens} token(s)"),
            ("eval duration", _duration(final.eval_s)),
            ("eval rate", f"{final.tok_s:.2f} tokens/s")]
    return "\n".join(f"{name + ':':22s}{value}" for name, value in rows)


class LineChat:
    def __init__(self, args: argparse.Namespace, store: SessionStore, client=None) -> None:
        self.args, self.store = args, store
        self.profile = profile_from_args(args)
        self.params = sampling_from_args(args, self.profile)
        self.client = client or LocalClient(engine_from_profile(self.profile), self.profile.name)
        self.session: Session | None = None
        self.messages: list[dict] = []
        self.attached: list[bytes] = []  # images and videos for the next message (`/image PATH`, `/video PATH`)

    def _system(self) -> list[dict]:
        return [{"role": "system", "content": self.args.system}] if getattr(self.args, "system", None) else []

    def new(self) -> None:
        self.session, self.messages = None, self._system()

    def resume(self, session: Session, show: bool = True) -> None:
        stored = self.store.messages(session.id)
        self.session = session
        self.messages = self._system() + [m.as_chat() for m in stored]
        if show:
            for m in stored[-SHOWN_ON_OPEN:]:
                mark = " [interrupted]" if m.interrupted else ""
                mark += f" [{len(m.images)} attachment{'s' * (len(m.images) > 1)}]" if m.images else ""
                print(f"[{m.role}]{mark} {m.content}", file=sys.stderr)

    def open(self, ref: str) -> None:
        s = self.store.find(ref)
        if s is None:
            raise UserError(f"no session {ref!r}", hint="/sessions lists them")
        self.resume(s)

    def send(self, text: str) -> None:
        """One turn: the reply streams to stdout and into the session (StreamedReply saves it as it comes); Ctrl+C
        stops it, and what came is kept, marked interrupted, in the session and here."""
        images, self.attached = self.attached, []  # a refused image is not tried again with the next message
        self.messages.append(with_images(text, images))
        reply = None
        try:
            reply = self.client.reply(self.messages, self.params)
            if self.session is None:
                self.session = self.store.create(model=self.profile.model, profile=self.profile.name)
            _, reply_id = self.store.add_turn(self.session.id, text, images)
        except BaseException as exc:  # nothing was said: the turn is not kept
            self.messages.pop()
            if reply is not None:
                reply.close()  # never read: its slot is given back here
            if isinstance(exc, KeyboardInterrupt):
                print("\n(stopped)", file=sys.stderr)
                return
            raise
        streamed = StreamedReply(self.store, reply_id)
        out, shown_reasoning = sys.stdout, False

        def show(ev: ReplyEvent) -> None:
            nonlocal shown_reasoning
            if ev.kind == "text":
                if shown_reasoning:
                    out.write("\n")
                    shown_reasoning = False
                out.write(ev.text)
            elif ev.kind == "reasoning" and out.isatty():
                out.write(f"\x1b[2m{ev.text}\x1b[0m")
                shown_reasoning = True
            out.flush()

        try:
            with quiet_keys(sys.stdin):
                streamed.follow(reply, show)
        except KeyboardInterrupt:
            print("\n(stopped)", file=sys.stderr)
        finally:
            self.messages.append({"role": "assistant", "content": streamed.text})
            out.write("\n")
            out.flush()
        if streamed.final is not None and getattr(self.args, "verbose", False):
            print(verbose_stats(streamed.final), file=sys.stderr)

    def switch_profile(self, name: str) -> None:
        """Another profile for the rest of this conversation; the current one stays if the new one fails."""
        old = self.args.profile
        self.args.profile = name
        try:
            profile = profile_from_args(self.args)
            params = sampling_from_args(self.args, profile)
            client = LocalClient(engine_from_profile(profile), profile.name)
        except BaseException:
            self.args.profile = old
            raise
        self.profile, self.params, self.client = profile, params, client

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
            self.switch_profile(rest)
            print(f"(profile {self.profile.name}: {self.client.label})", file=sys.stderr)
        elif cmd == "/image" and rest:
            self.attached.append(read_image(rest, "/image", self.profile.image_max_mib))
            print(f"(image {len(self.attached)} attached: {rest}, {len(self.attached[-1]) >> 10} KiB; it goes with "
                  "your next message; /image alone drops them)", file=sys.stderr)
        elif cmd == "/video" and rest:
            self.attached.append(read_image(rest, "/video", self.profile.video_max_mib, "video"))
            print(f"(video {len(self.attached)} attached: {rest}, {len(self.attached[-1]) >> 10} KiB; it goes with "
                  "your next message; /image alone drops the attachments)", file=sys.stderr)
        elif cmd in ("/image", "/video"):
            print(f"({len(self.attached)} attachment{'s' * (len(self.attached) != 1)} dropped)", file=sys.stderr)
            self.attached = []
        else:
            print(HELP, file=sys.stderr)
        return True


def run_chat(args: argparse.Namespace) -> int:
    """A chat in the terminal, or one reply: to a prompt piped in, or given as an argument (`ninfer run MODEL
    PROMPT`; piped text comes first, then the argument's). Everything a flag or a file can get wrong (the history
    database, --session) is checked before the model loads, in every mode."""
    if args.session and getattr(args, "new", False):
        raise UserError("--session and --new contradict each other", hint="drop one of them")
    with contextlib.closing(SessionStore()) as store:
        session = None
        if args.session:
            session = store.find(args.session)
            if session is None:
                raise UserError(f"no session {args.session!r}", hint="`/sessions` in `ninfer chat` lists the saved "
                                "ones (id or title); `ninfer chat` without --session starts a new one")
        interactive = sys.stdin.isatty()
        once = [] if interactive else [sys.stdin.read().strip()]
        once = [p for p in (*once, getattr(args, "prompt", None) or "") if p]
        if not interactive and not once:
            raise UserError("no prompt on stdin", hint="pipe some text in, e.g. echo 'Hi' | ninfer")
        chat = LineChat(args, store)
        if session is not None:
            chat.resume(session, show=not once)
        else:
            chat.new()
        if once:
            chat.send("\n\n".join(once))
            return 0
        from prompt_toolkit import PromptSession
        from prompt_toolkit.history import FileHistory

        from . import paths

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
        try:
            if text.startswith("/"):
                if not chat.command(text):
                    return 0
            else:
                chat.send(line)
        except UserError as exc:  # a bad command or a prompt too long for the context: say so, keep chatting
            print(f"error: {exc}" + (f" ({exc.hint})" if exc.hint else ""), file=sys.stderr)
