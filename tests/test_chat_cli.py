"""`ninfer chat`: --session the same in every mode, replies saved as they stream (a killed chat leaves whole
turns), keys typed during a reply kept off the screen, ollama's --verbose, and a bad history database reported."""
import dataclasses
import os
import pty
import re
import select
import signal
import subprocess
import sys
import termios
import time

import pytest

from engine.errors import ContextOverflowError, UserError
from ninfer_tui import sessions
from ninfer_tui.chat import LineChat, loop, quiet_keys, verbose_stats
from ninfer_tui.chat_client import LocalClient, Reply, ReplyEvent
from ninfer_tui.cli import build_parser
from ninfer_tui.sessions import SessionStore

from .conftest import ROOT, idle, run_cli


class FakeClient:
    """A model that says `pieces` one by one; `hook(i)` runs before piece i (a test looks around there), and a
    KeyboardInterrupt at `stop_at` stands for Ctrl+C."""

    label, profile = "fake", "cpu-default"

    def __init__(self, pieces: list[str], stop_at: int | None = None, hook=None) -> None:
        self.pieces, self.stop_at, self.hook = pieces, stop_at, hook
        self.seen: list[dict] = []
        self.cancelled = False

    def reply(self, messages, params) -> Reply:
        self.seen, self.cancelled = [dict(m) for m in messages], False

        def events():
            for i, piece in enumerate(self.pieces):
                if self.hook:
                    self.hook(i)
                if i == self.stop_at:
                    raise KeyboardInterrupt
                yield ReplyEvent("text", piece, i + 1)
            yield ReplyEvent("done", "", len(self.pieces), 12, 0, 8.0, "stop", 12, 0.25, 0.5, 0.8)

        def cancel():
            self.cancelled = True

        return Reply(events(), cancel)


def line_chat(client, *flags: str) -> LineChat:
    args = build_parser().parse_args(["chat", "--profile", "cpu-default", *flags])
    chat = LineChat(args, SessionStore(), client=client)
    chat.new()
    return chat


def test_stopped_reply_is_kept_marked_interrupted_and_the_next_turn_follows_it(capsys):
    chat = line_chat(FakeClient(["Once", " upon", " a", " time"], stop_at=2))
    chat.send("tell me a story")
    assert chat.client.cancelled  # the engine was told to stop (its slot freed)
    assert "(stopped)" in capsys.readouterr().err
    stored = chat.store.messages(chat.session.id)
    assert [(m.role, m.content, m.interrupted) for m in stored] == [
        ("user", "tell me a story", False), ("assistant", "Once upon", True)]
    assert chat.messages[-1] == {"role": "assistant", "content": "Once upon"}  # what the model sees next
    chat.client = FakeClient(["Sure."])
    chat.send("go on")
    assert [m["role"] for m in chat.client.seen] == ["user", "assistant", "user"]
    stored = chat.store.messages(chat.session.id)
    assert [m.role for m in stored] == ["user", "assistant", "user", "assistant"]
    assert (stored[-1].content, stored[-1].interrupted) == ("Sure.", False)


def test_reply_is_saved_while_it_streams(monkeypatch):
    monkeypatch.setattr(sessions, "SAVE_EVERY_S", 0.0)
    pieces = ["a", "b", "c", "d"]
    seen = []

    def look(i):  # before piece i, the session holds pieces 0..i-1, marked interrupted
        if i:
            reply = chat.store.messages(chat.session.id)[-1]
            seen.append((reply.content, reply.interrupted))

    chat = line_chat(FakeClient(pieces, hook=look))
    chat.send("spell")
    assert seen == [("a", True), ("ab", True), ("abc", True)]
    last = chat.store.messages(chat.session.id)[-1]
    assert (last.content, last.tokens, last.interrupted) == ("abcd", 4, False)


class Lines:
    """Typed lines for `loop`, then Ctrl+D."""

    def __init__(self, *lines: str) -> None:
        self.lines = list(lines)

    def prompt(self, _message: str) -> str:
        if not self.lines:
            raise EOFError
        return self.lines.pop(0)


def test_a_prompt_the_model_refuses_leaves_no_turn_and_the_chat_goes_on(capsys):
    chat = line_chat(FakeClient(["Fine."]))
    answer = chat.client.reply

    def reply(messages, params):
        if messages[-1]["content"].startswith("a very long"):
            raise ContextOverflowError(9000, 512, 8192)
        return answer(messages, params)

    chat.client.reply = reply
    assert loop(chat, Lines("a very long prompt", "a short one")) == 0
    assert "error: prompt (9000 tokens) + max_tokens (512) exceeds" in capsys.readouterr().err
    assert [(m.role, m.content) for m in chat.store.messages(chat.session.id)] == [
        ("user", "a short one"), ("assistant", "Fine.")]
    assert [m["content"] for m in chat.messages] == ["a short one", "Fine."]


def test_the_engines_slot_is_given_back_however_a_turn_ends(default_engine, monkeypatch, capsys):
    """A reply is requested before its turn is stored (so a prompt the model refuses stores nothing): when storing
    then fails, the request, never read, still gives its running slot back; so does one left mid-stream."""
    chat = line_chat(LocalClient(default_engine, "cpu-default"))
    chat.params = dataclasses.replace(chat.params, max_tokens=8)

    def locked(*args):
        raise UserError("the chat history database is unreadable (database is locked)")

    with monkeypatch.context() as m:
        m.setattr(chat.store, "add_turn", locked)
        with pytest.raises(UserError, match="database is locked"):
            chat.send("hi")
    assert idle(default_engine) == (0, 0) and chat.messages == []

    class Gone:  # a stdout whose reader went away (a closed pipe)
        def write(self, text: str) -> None:
            raise BrokenPipeError("stdout closed")

        def flush(self) -> None:
            pass

        def isatty(self) -> bool:
            return False

    with monkeypatch.context() as m:
        m.setattr(sys, "stdout", Gone())
        with pytest.raises(BrokenPipeError):
            chat.send("hi")
    assert idle(default_engine) == (0, 0)
    assert chat.store.messages(chat.session.id)[-1].interrupted
    chat.send("go on")  # and the next turn runs
    last = chat.store.messages(chat.session.id)[-1]
    assert capsys.readouterr().out == last.content + "\n" and not last.interrupted


def test_open_shows_an_interrupted_reply_as_such(capsys):
    store = SessionStore()
    sid = store.create().id
    _, rid = store.add_turn(sid, "hello")
    store.update(rid, "Hi, I am", tokens=3, interrupted=True)
    chat = line_chat(FakeClient([]))
    chat.open(str(sid))
    err = capsys.readouterr().err
    assert "[user] hello" in err and "[assistant] [interrupted] Hi, I am" in err
    assert chat.messages[-1] == {"role": "assistant", "content": "Hi, I am"}


def _attrs_echo(fd: int) -> bool:
    return bool(termios.tcgetattr(fd)[3] & termios.ECHO)


def _pending(fd: int) -> bytes:
    out = b""
    while select.select([fd], [], [], 0.05)[0]:
        out += os.read(fd, 1024)
    return out


@pytest.mark.parametrize("stop_at", [None, 1])
def test_keys_typed_during_a_reply_are_not_echoed_and_are_dropped(monkeypatch, stop_at):
    master, slave = pty.openpty()
    tty = os.fdopen(slave, "r")
    monkeypatch.setattr(sys, "stdin", tty)
    during = []

    def type_keys(i):
        if i == 0:
            os.write(master, b"zzz\n")  # a whole line: readable at once unless dropped
            time.sleep(0.05)
            during.append((_attrs_echo(slave), _pending(master)))

    try:
        assert _attrs_echo(slave)
        chat = line_chat(FakeClient(["x", "y"], stop_at=stop_at, hook=type_keys))
        chat.send("hi")
        assert during == [(False, b"")]  # not echoed while the reply streamed
        assert _attrs_echo(slave)  # restored, after a whole reply and after Ctrl+C
        assert not select.select([slave], [], [], 0.05)[0]  # the typed line was dropped, not left for the prompt
    finally:
        tty.close()
        os.close(master)


def test_a_terminal_that_refuses_its_settings_leaves_sigterm_as_it_was(monkeypatch):
    master, slave = pty.openpty()
    tty = os.fdopen(slave, "r")
    before = signal.getsignal(signal.SIGTERM)

    def refuse(*args):
        raise termios.error(5, "Input/output error")

    monkeypatch.setattr(termios, "tcsetattr", refuse)
    try:
        with pytest.raises(termios.error), quiet_keys(tty):
            pass
        assert signal.getsignal(signal.SIGTERM) is before
    finally:
        tty.close()
        os.close(master)


def test_verbose_stats_in_ollamas_shape():
    final = ReplyEvent("done", "", 64, 40, 28, 31.25, "stop", 12, 0.25, 2.016, 2.5)
    assert verbose_stats(final).splitlines() == [
        "total duration:       2.500s",
        "prompt eval count:    12 token(s) (+28 cached)",
        "prompt eval duration: 250.00ms",
        "prompt eval rate:     48.00 tokens/s",
        "eval count:           64 token(s)",
        "eval duration:        2.016s",
        "eval rate:            31.25 tokens/s",
    ]


# ---- the CLI, as a subprocess ------------------------------------------------------------------------------

def run_on_a_terminal(*args: str, timeout: int = 120) -> tuple[int, str]:
    """The CLI with a pseudo-terminal for stdin, stdout and stderr (an interactive chat); returns (exit code,
    what it printed)."""
    master, slave = pty.openpty()
    proc = subprocess.Popen([sys.executable, "-m", "ninfer_tui.cli", *args], stdin=slave, stdout=slave,
                            stderr=slave, cwd=ROOT, start_new_session=True)
    os.close(slave)
    out, end = b"", time.monotonic() + timeout
    try:
        while time.monotonic() < end:
            if select.select([master], [], [], 0.2)[0]:
                try:
                    chunk = os.read(master, 4096)
                except OSError:  # the child closed the terminal
                    break
                if not chunk:
                    break
                out += chunk
            elif proc.poll() is not None:
                break
        return proc.wait(timeout=max(1.0, end - time.monotonic())), out.decode(errors="replace")
    finally:
        if proc.poll() is None:
            proc.kill()
        os.close(master)


def test_unknown_session_is_an_error_before_the_model_loads():
    piped = run_cli("chat", "--session", "nosuch", stdin="hi")
    code, shown = run_on_a_terminal("chat", "--session", "nosuch")
    for rc, text in ((piped.returncode, piped.stderr), (code, shown)):
        assert rc == 2, text
        assert "error: no session 'nosuch'" in text and "`/sessions`" in text and "without --session" in text
        assert "loading" not in text
    both = run_cli("chat", "--session", "1", "--new", stdin="hi")
    assert both.returncode == 2 and "contradict" in both.stderr


def test_corrupt_history_database_exits_2_and_is_kept(tmp_path):
    path = tmp_path / "data" / "sessions.db"
    path.parent.mkdir()
    path.write_bytes(b"not a database" * 300)
    r = run_cli("chat", stdin="hi", env={"NINFER_DATA_DIR": str(path.parent)})
    assert r.returncode == 2
    assert f"error: the chat history database {path} is corrupt" in r.stderr
    assert "hint: move it aside" in r.stderr and "loading" not in r.stderr
    assert path.read_bytes() == b"not a database" * 300


def test_piped_chat_is_saved_as_it_streams_and_kill_9_leaves_whole_turns():
    """A piped chat without --session is saved (it shows in /sessions); killed mid-reply it leaves its turn with
    the partial reply marked interrupted; the next turn through --session follows it, with --verbose stats."""
    proc = subprocess.Popen([sys.executable, "-m", "ninfer_tui.cli", "chat", "--profile", "cpu-default", "-n", "400",
                             "--temperature", "0"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, cwd=ROOT)
    proc.stdin.write(b"Write a long story about a dragon who learns to cook.")
    proc.stdin.close()
    try:
        first = os.read(proc.stdout.fileno(), 64)  # the reply has begun
        assert first, "the chat ended before its reply"
        time.sleep(1.5)  # a few more tokens, and the session saved at least once after the first
        assert proc.poll() is None, "the reply finished before it could be cut"
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        shown = (first + proc.stdout.read()).decode(errors="replace")
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.stdout.close()
    store = SessionStore()
    (session,) = store.list()
    assert session.title == "Write a long story about a dragon who learns to cook."
    user, reply = store.messages(session.id)
    assert user.role == "user" and reply.role == "assistant" and reply.interrupted
    assert reply.content and shown.startswith(reply.content)  # saved as shown, up to its last save

    r = run_cli("chat", "--profile", "cpu-default", "--session", str(session.id), "-n", "4", "--temperature", "0",
                "--verbose", stdin="Go on.")
    assert r.returncode == 0, r.stderr
    for line in ("prompt eval count:", "prompt eval rate:", "eval count:    ", "eval rate:", "total duration:"):
        assert line in r.stderr
    assert re.search(r"^eval rate: +\d+\.\d\d tokens/s$", r.stderr, re.M)
    assert r.stdout.strip() and "eval" not in r.stdout  # the stats go to stderr, the reply alone to stdout
    messages = store.messages(session.id)
    assert [m.role for m in messages] == ["user", "assistant", "user", "assistant"]
    assert [m.interrupted for m in messages] == [False, True, False, False]
    assert len(store.list()) == 1
