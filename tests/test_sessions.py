"""The chat history database: replies saved as they stream (marked interrupted), old databases migrated, and a
damaged, empty or foreign file reported with its path and kept, never replaced."""
import os
import sqlite3
import subprocess
import sys
import textwrap
import time

import pytest

from engine.errors import UserError
from ninfer_tui import sessions
from ninfer_tui.chat_client import Reply, ReplyEvent
from ninfer_tui.sessions import SessionStore, StreamedReply

from .conftest import ROOT

# The schema of the first release (no `interrupted` column): a database a user already has.
OLD_SCHEMA = """
CREATE TABLE sessions (id INTEGER PRIMARY KEY, title TEXT NOT NULL, model TEXT NOT NULL DEFAULT '',
    profile TEXT NOT NULL DEFAULT '', created REAL NOT NULL, updated REAL NOT NULL);
CREATE TABLE messages (id INTEGER PRIMARY KEY, session_id INTEGER NOT NULL REFERENCES sessions(id) ON DELETE CASCADE,
    role TEXT NOT NULL, content TEXT NOT NULL, reasoning TEXT NOT NULL DEFAULT '', tokens INTEGER NOT NULL DEFAULT 0,
    created REAL NOT NULL);
"""


def test_new_database_is_made_whole_where_none_is(tmp_path):
    path = tmp_path / "s.db"
    store = SessionStore(path)
    sid = store.create().id
    store.add(sid, "user", "hi")
    store.close()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["s.db"]  # nothing left of its making
    again = SessionStore(path)
    assert [m.content for m in again.messages(sid)] == ["hi"]


def test_add_update_and_add_turn_keep_interrupted():
    store = SessionStore()
    sid = store.create().id
    uid, rid = store.add_turn(sid, "tell me a story")
    user, reply = store.messages(sid)
    assert (user.id, user.role, user.interrupted) == (uid, "user", False)
    assert (reply.id, reply.role, reply.content, reply.interrupted) == (rid, "assistant", "", True)
    assert store.get(sid).title == "tell me a story"
    store.update(rid, "Once", tokens=1, interrupted=True)
    assert store.messages(sid)[1].content == "Once" and store.messages(sid)[1].interrupted
    store.update(rid, "Once upon a time.", "thinking", tokens=5)
    done = store.messages(sid)[1]
    assert (done.content, done.reasoning, done.tokens, done.interrupted) == ("Once upon a time.", "thinking", 5, False)
    mid = store.add(sid, "assistant", "cut", interrupted=True)
    assert store.messages(sid)[-1].id == mid and store.messages(sid)[-1].interrupted


class Recorded(Reply):
    """A reply of `pieces` then `end` (a "done" event's finish reason, or an exception raised instead), which
    records whether it was closed."""

    def __init__(self, pieces: list[str], end: str | Exception) -> None:
        self.closed = False

        def events():
            for i, piece in enumerate(pieces):
                yield ReplyEvent("text", piece, i + 1)
            if isinstance(end, Exception):
                raise end
            yield ReplyEvent("done", "", len(pieces), 3, 0, 9.0, end)

        super().__init__(events(), lambda: None, lambda: setattr(self, "closed", True))


@pytest.mark.parametrize("end,interrupted", [("stop", False), ("length", False), ("cancelled", True),
                                             (OSError("connection reset"), True)])
def test_streamed_reply_is_saved_as_it_comes_and_however_it_ends(monkeypatch, end, interrupted):
    monkeypatch.setattr(sessions, "SAVE_EVERY_S", 0.0)
    store = SessionStore()
    sid = store.create().id
    _, rid = store.add_turn(sid, "spell")
    reply, streamed, seen = Recorded(["a", "b", "c"], end), StreamedReply(store, rid), []

    def show(ev):  # before each event is saved, the row holds the ones before it, marked interrupted
        row = store.messages(sid)[1]
        seen.append((row.content, row.interrupted))

    if isinstance(end, Exception):
        with pytest.raises(OSError):
            streamed.follow(reply, show)
    else:
        streamed.follow(reply, show)
    assert seen[:3] == [("", True), ("a", True), ("ab", True)]
    row = store.messages(sid)[1]
    assert (row.content, row.tokens, row.interrupted) == ("abc", 3, interrupted) and streamed.interrupted == interrupted
    assert reply.closed == isinstance(end, Exception)  # left before its end: closed, its slot freed


def test_a_failed_commit_leaves_no_transaction_open():
    """A COMMIT that fails (here a deferred constraint; on a real disk, a full one) rolls back, so the next write
    can begin."""
    db = sqlite3.connect(":memory:", isolation_level=None)
    db.execute("PRAGMA foreign_keys=ON")
    db.executescript("CREATE TABLE p (id INTEGER PRIMARY KEY);"
                     "CREATE TABLE c (p INTEGER REFERENCES p(id) DEFERRABLE INITIALLY DEFERRED);")
    with pytest.raises(sqlite3.IntegrityError), sessions._write(db):
        db.execute("INSERT INTO c VALUES (1)")
    assert not db.in_transaction
    with sessions._write(db):
        db.execute("INSERT INTO p VALUES (1)")
    assert db.execute("SELECT count(*) FROM p").fetchone() == (1,)
    db.close()


def test_old_database_gains_the_interrupted_column(tmp_path):
    path = tmp_path / "old.db"
    db = sqlite3.connect(path)
    db.executescript(OLD_SCHEMA)
    db.execute("INSERT INTO sessions VALUES (1, 'old chat', 'm', 'p', 1.0, 1.0)")
    db.execute("INSERT INTO messages VALUES (1, 1, 'user', 'hello', '', 0, 1.0)")
    db.execute("INSERT INTO messages VALUES (2, 1, 'assistant', 'hi there', '', 2, 1.0)")
    db.commit()
    db.close()
    store = SessionStore(path)
    assert [(m.content, m.interrupted) for m in store.messages(1)] == [("hello", False), ("hi there", False)]
    store.add(1, "assistant", "part", interrupted=True)
    store.close()
    again = SessionStore(path)  # a migrated database opens as it is
    assert [m.interrupted for m in again.messages(1)] == [False, False, True]


def test_old_attachments_gain_the_name_column(tmp_path):
    """A database of the first release with images (attachments without their files' names) opens: those keep no
    name, and new ones keep theirs."""
    import hashlib

    from ninfer_tui.attachments import Attachment

    path = tmp_path / "old.db"
    db = sqlite3.connect(path)
    db.executescript(OLD_SCHEMA + "ALTER TABLE messages ADD COLUMN interrupted INTEGER NOT NULL DEFAULT 0;"
                     "CREATE TABLE attachments (message_id INTEGER NOT NULL REFERENCES messages(id) ON DELETE "
                     "CASCADE, position INTEGER NOT NULL, digest TEXT NOT NULL, PRIMARY KEY (message_id, position));")
    digest = hashlib.sha256(b"old picture").hexdigest()
    (tmp_path / "attachments").mkdir()
    (tmp_path / "attachments" / digest).write_bytes(b"old picture")
    db.execute("INSERT INTO sessions VALUES (1, 'old chat', 'm', 'p', 1.0, 1.0)")
    db.execute("INSERT INTO messages VALUES (1, 1, 'user', 'look', '', 0, 1.0, 0)")
    db.execute("INSERT INTO attachments VALUES (1, 0, ?)", (digest,))
    db.commit()
    db.close()
    store = SessionStore(path)
    store.add_turn(1, "and this", [b"new picture", b"old picture"], ["new.png", "again.png"])
    assert [m.attachments for m in store.messages(1) if m.role == "user"] == [
        [Attachment("", b"old picture")],
        [Attachment("new.png", b"new picture"), Attachment("again.png", b"old picture")]]
    assert store.messages(1)[0].images == [b"old picture"]


def _damaged_pages(path):
    store = SessionStore(path)
    sid = store.create().id
    for i in range(200):
        store.add(sid, "user", f"message {i} " * 20)
    store.close()
    data = bytearray(path.read_bytes())
    data[4096:8192] = b"\xa5" * 4096  # the second page: the header is fine, a table's page is not
    path.write_bytes(bytes(data))


def _foreign(path):
    db = sqlite3.connect(path)
    db.execute("CREATE TABLE notes (x)")
    db.commit()
    db.close()


@pytest.mark.parametrize("make,cause", [
    (lambda p: p.write_bytes(os.urandom(4096)), "is corrupt (file is not a database)"),
    (lambda p: p.write_bytes(b""), "is empty (0 bytes)"),
    (_foreign, "is not a ninfer chat history"),
    (_damaged_pages, "is corrupt"),
    (lambda p: p.mkdir(), "is not a regular file"),
])
def test_a_bad_database_is_reported_and_kept(tmp_path, make, cause):
    path = tmp_path / "sessions.db"
    make(path)
    before = path.read_bytes() if path.is_file() else None
    with pytest.raises(UserError) as err:
        SessionStore(path)
    assert f"the chat history database {path} {cause}" in str(err.value)
    assert err.value.hint and str(path) in err.value.hint
    if before is not None:
        assert path.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["sessions.db"]  # nothing made beside it either


def test_kill_9_mid_turn_leaves_whole_turns(tmp_path):
    """A writer killed at any moment: every user turn is followed by its reply, the cut one marked interrupted."""
    db = tmp_path / "s.db"
    writer = textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {str(ROOT)!r})
        from pathlib import Path
        from ninfer_tui.sessions import SessionStore
        s = SessionStore(Path({str(db)!r}))
        sid = s.create().id
        n = 0
        while True:
            n += 1
            _, rid = s.add_turn(sid, f"question {{n}}")
            if n == 1:
                print("ready", flush=True)  # a turn is in, however slowly a busy machine got here
            for k in range(1, 4):
                s.update(rid, "token " * k, tokens=k, interrupted=True)
            s.update(rid, "token " * 4, tokens=4)
    """)
    proc = subprocess.Popen([sys.executable, "-c", writer], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "ready"
    time.sleep(0.5)
    os.kill(proc.pid, 9)
    proc.wait()
    store = SessionStore(db)
    messages = store.messages(store.list()[0].id)
    assert len(messages) >= 2 and len(messages) % 2 == 0
    assert [m.role for m in messages] == ["user", "assistant"] * (len(messages) // 2)
    assert all(m.content == "token " * 4 and not m.interrupted for m in messages[1:-2:2])
    last = messages[-1]
    assert last.interrupted == (last.tokens < 4) and last.content == "token " * last.tokens
