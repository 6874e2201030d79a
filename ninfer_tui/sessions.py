"""Chat sessions in SQLite (the platformdirs data dir), shared by the TUI and the line chat.

Every change is one transaction and the database runs in WAL mode, so a process killed mid-reply leaves a valid
database holding the reply up to its last saved piece (marked interrupted until it finishes). A database is only
ever created whole (written beside its path, then linked into place), so a file at the path that is not one with
ninfer's tables (empty, truncated, corrupt, someone else's) is reported with its path and kept, never replaced.
"""
from __future__ import annotations

import contextlib
import hashlib
import os
import sqlite3
import stat
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from engine.errors import UserError

from . import paths
from .attachments import Attachment, with_images

if TYPE_CHECKING:
    from .chat_client import Reply, ReplyEvent

# A message's images and videos, in order, by the SHA-256 of their bytes: the files sit in `attachments/` beside
# the database, one per content (a screenshot resent in every turn is stored once); each row keeps the name its file
# had, for the message's chip.
ATTACHMENTS_TABLE = """
CREATE TABLE IF NOT EXISTS attachments (
    message_id INTEGER NOT NULL REFERENCES messages(id) ON DELETE CASCADE, position INTEGER NOT NULL,
    digest TEXT NOT NULL, name TEXT NOT NULL DEFAULT '', PRIMARY KEY (message_id, position));
"""
SCHEMA = """
CREATE TABLE IF NOT EXISTS sessions (
    id INTEGER PRIMARY KEY, title TEXT NOT NULL, model TEXT NOT NULL DEFAULT '', profile TEXT NOT NULL DEFAULT '',
    created REAL NOT NULL, updated REAL NOT NULL);
CREATE TABLE IF NOT EXISTS messages (
    id INTEGER PRIMARY KEY, session_id INTEGER NOT NULL REFERENCES sessions(id) ON DELETE CASCADE,
    role TEXT NOT NULL, content TEXT NOT NULL, reasoning TEXT NOT NULL DEFAULT '', tokens INTEGER NOT NULL DEFAULT 0,
    created REAL NOT NULL, interrupted INTEGER NOT NULL DEFAULT 0);
CREATE INDEX IF NOT EXISTS messages_by_session ON messages(session_id, id);
""" + ATTACHMENTS_TABLE
# Columns added after the first release, by table, with their definitions: an older database gains them when opened.
ADDED_COLUMNS = {"messages": {"interrupted": "INTEGER NOT NULL DEFAULT 0"},
                 "attachments": {"name": "TEXT NOT NULL DEFAULT ''"}}
TITLE_CHARS = 60
SAVE_EVERY_S = 0.5  # a streaming reply is written to its row this often (and at its first piece)
# sqlite's result codes for a file that is not (or no longer) a database.
_DAMAGED = {"SQLITE_CORRUPT", "SQLITE_NOTADB"}


@dataclass
class Session:
    id: int
    title: str
    model: str
    profile: str
    created: float
    updated: float


@dataclass
class Message:
    id: int
    role: str
    content: str
    reasoning: str = ""
    tokens: int = 0
    interrupted: bool = False  # a reply cut off (stopped, or its process ended) before it finished
    attachments: list[Attachment] = field(default_factory=list)  # a user message's images and videos

    @property
    def images(self) -> list[bytes]:
        return [a.data for a in self.attachments]

    def as_chat(self) -> dict:
        if self.images:
            return with_images(self.content, self.images)
        return {"role": self.role, "content": self.content}


def title_from(text: str) -> str:
    line = " ".join(text.split())
    return line if len(line) <= TITLE_CHARS else line[: TITLE_CHARS - 1] + "…"


def _unusable(path: Path, what: str, hint: str | None = None) -> UserError:
    return UserError(f"the chat history database {path} {what}", hint=hint or (
        f"move it aside (mv {path} {path}.bad) and ninfer starts a new, empty history; `sqlite3 {path} .recover` "
        "may save its sessions"))


def _db_error(path: Path, exc: sqlite3.Error) -> UserError:
    if getattr(exc, "sqlite_errorname", "") in _DAMAGED:
        return _unusable(path, f"is corrupt ({exc})")
    return _unusable(path, f"is unreadable ({exc})", hint="check the file's permissions and that no other program "
                     "holds it locked")


@contextlib.contextmanager
def _write(db: sqlite3.Connection) -> Iterator[sqlite3.Connection]:
    """One write transaction: all its statements land, or none (the connection is in autocommit mode, where each
    statement alone would be its own). A failed COMMIT rolls back too, so the connection is never left inside a
    transaction that every later BEGIN would trip over."""
    db.execute("BEGIN IMMEDIATE")
    try:
        yield db
        db.execute("COMMIT")
    except BaseException:
        if db.in_transaction:
            db.execute("ROLLBACK")
        raise


class SessionStore:
    def __init__(self, path: Path | None = None) -> None:
        self.path = path or paths.data_dir() / "sessions.db"
        if not os.path.lexists(self.path):
            self._create()
        self.db = self._open()
        self._lock = threading.RLock()  # the TUI writes from its generation thread and reads from the UI thread

    def _create(self) -> None:
        """A new database with the schema, made beside the path and linked into place: a file at the path is
        always a whole database (another process making one at the same moment wins; its file is used)."""
        tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.{threading.get_ident()}.new")
        try:
            db = sqlite3.connect(tmp, isolation_level=None)
            try:
                db.execute("PRAGMA journal_mode=WAL")
                db.executescript(SCHEMA)
            finally:
                db.close()
            with contextlib.suppress(FileExistsError):
                os.link(tmp, self.path)
        except (OSError, sqlite3.Error) as exc:
            raise UserError(f"cannot create the chat history database {self.path}: {exc}",
                            hint=f"check that {self.path.parent} is writable") from None
        finally:
            for leftover in (tmp, Path(f"{tmp}-wal"), Path(f"{tmp}-shm")):
                leftover.unlink(missing_ok=True)

    def _open(self) -> sqlite3.Connection:
        try:
            st = os.stat(self.path)
        except OSError as exc:
            raise _unusable(self.path, f"is unreadable ({exc.strerror})", hint="check the path and its "
                            "permissions") from None
        if not stat.S_ISREG(st.st_mode):
            raise _unusable(self.path, "is not a regular file", hint=f"move {self.path} away and ninfer starts a "
                            "new, empty history")
        if st.st_size == 0:  # sqlite would take it for a new database; ninfer never leaves one empty
            raise _unusable(self.path, "is empty (0 bytes): not a ninfer chat history",
                            hint=f"remove it (rm {self.path}) and ninfer starts a new, empty history")
        try:
            db = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None, timeout=10)
        except sqlite3.Error as exc:
            raise _db_error(self.path, exc) from None
        try:
            check = db.execute("PRAGMA quick_check").fetchall()
            if check != [("ok",)]:
                raise _unusable(self.path, f"is corrupt ({check[0][0]})")
            tables = {r[0] for r in db.execute("SELECT name FROM sqlite_master WHERE type='table'")}
            if not {"sessions", "messages"} <= tables:
                raise _unusable(self.path, "is not a ninfer chat history (it has no sessions and messages tables)",
                                hint=f"move it aside (mv {self.path} {self.path}.bad) and ninfer starts a new, "
                                "empty history")
            db.execute("PRAGMA journal_mode=WAL")
            db.execute("PRAGMA foreign_keys=ON")
            self._migrate(db)
        except BaseException as exc:
            db.close()
            if isinstance(exc, sqlite3.Error):
                raise _db_error(self.path, exc) from None
            raise
        return db

    @staticmethod
    def _migrate(db: sqlite3.Connection) -> None:
        tables = {r[0] for r in db.execute("SELECT name FROM sqlite_master WHERE type='table'")}
        if "attachments" not in tables:
            with _write(db):
                db.execute(ATTACHMENTS_TABLE)

        def missing() -> list[tuple[str, str, str]]:
            out = []
            for table, columns in ADDED_COLUMNS.items():
                have = {r[1] for r in db.execute(f"PRAGMA table_info({table})")}
                out += [(table, name, sql) for name, sql in columns.items() if name not in have]
            return out

        if not missing():
            return
        with _write(db):  # another process may be migrating the same file: check again under the lock
            for table, name, sql in missing():
                db.execute(f"ALTER TABLE {table} ADD COLUMN {name} {sql}")

    def close(self) -> None:
        self.db.close()

    @contextlib.contextmanager
    def _transaction(self) -> Iterator[sqlite3.Connection]:
        with self._lock:
            try:
                with _write(self.db) as db:
                    yield db
            except sqlite3.Error as exc:
                raise _db_error(self.path, exc) from None

    def _tx(self, sql: str, args: tuple = ()) -> sqlite3.Cursor:
        with self._transaction() as db:
            return db.execute(sql, args)

    def _rows(self, sql: str, args: tuple = ()) -> list[tuple]:
        with self._lock:
            try:
                return self.db.execute(sql, args).fetchall()
            except sqlite3.Error as exc:
                raise _db_error(self.path, exc) from None

    def create(self, title: str = "New chat", model: str = "", profile: str = "") -> Session:
        now = time.time()
        cur = self._tx("INSERT INTO sessions(title, model, profile, created, updated) VALUES (?,?,?,?,?)",
                       (title, model, profile, now, now))
        return self.get(cur.lastrowid)

    def get(self, session_id: int) -> Session | None:
        rows = self._rows("SELECT id, title, model, profile, created, updated FROM sessions WHERE id=?",
                          (session_id,))
        return Session(*rows[0]) if rows else None

    def find(self, name_or_id: str) -> Session | None:
        """A session by id, or by exact title (the newest such)."""
        if name_or_id.isdigit() and (s := self.get(int(name_or_id))):
            return s
        rows = self._rows("SELECT id FROM sessions WHERE title=? ORDER BY updated DESC LIMIT 1", (name_or_id,))
        return self.get(rows[0][0]) if rows else None

    def list(self, search: str = "") -> list[Session]:
        if search:
            like = f"%{search}%"
            rows = self._rows(
                "SELECT id, title, model, profile, created, updated FROM sessions WHERE title LIKE ? OR id IN "
                "(SELECT session_id FROM messages WHERE content LIKE ?) ORDER BY updated DESC", (like, like))
        else:
            rows = self._rows("SELECT id, title, model, profile, created, updated FROM sessions ORDER BY updated DESC")
        return [Session(*r) for r in rows]

    def rename(self, session_id: int, title: str) -> None:
        self._tx("UPDATE sessions SET title=?, updated=? WHERE id=?", (title, time.time(), session_id))

    def delete(self, session_id: int) -> None:
        """A session, its messages and the attachment files no other session's message names."""
        digests = {r[0] for r in self._rows("SELECT digest FROM attachments WHERE message_id IN (SELECT id FROM "
                                            "messages WHERE session_id=?)", (session_id,))}
        self._tx("DELETE FROM sessions WHERE id=?", (session_id,))
        for digest in digests:
            if not self._rows("SELECT 1 FROM attachments WHERE digest=? LIMIT 1", (digest,)):
                (self.attachments / digest).unlink(missing_ok=True)

    def messages(self, session_id: int) -> list[Message]:
        """A session's messages with their attachments (an attachment whose file is gone is left out)."""
        rows = self._rows("SELECT id, role, content, reasoning, tokens, interrupted FROM messages WHERE session_id=? "
                          "ORDER BY id", (session_id,))
        out = [Message(*r[:5], interrupted=bool(r[5])) for r in rows]
        by_id = {m.id: m for m in out}
        for message_id, digest, name in self._rows(
                "SELECT message_id, digest, name FROM attachments WHERE message_id IN (SELECT id FROM messages WHERE "
                "session_id=?) ORDER BY message_id, position", (session_id,)):
            with contextlib.suppress(OSError):
                by_id[message_id].attachments.append(Attachment(name, (self.attachments / digest).read_bytes()))
        return out

    def message_ids(self, session_id: int) -> list[int]:
        """A session's message ids in order: what a front end needs to drop or rewrite its last rows, without reading
        every attachment's file as `messages` does."""
        return [r[0] for r in self._rows("SELECT id FROM messages WHERE session_id=? ORDER BY id", (session_id,))]

    @property
    def attachments(self) -> Path:
        return self.path.parent / "attachments"

    def _store_images(self, images: list[bytes]) -> list[str]:
        """Each image's file (written whole, then moved into place, unless one with its content is there), by
        digest."""
        digests = []
        for data in images:
            digest = hashlib.sha256(data).hexdigest()
            path = self.attachments / digest
            if not path.exists():
                tmp = path.with_name(f".{digest}.{os.getpid()}.{threading.get_ident()}.new")
                try:
                    self.attachments.mkdir(parents=True, exist_ok=True)
                    tmp.write_bytes(data)
                    os.replace(tmp, path)
                except OSError as exc:
                    tmp.unlink(missing_ok=True)
                    raise UserError(f"cannot save an attachment in {self.attachments}: {exc.strerror or exc}",
                                    hint=f"check that {self.attachments.parent} is writable") from None
            digests.append(digest)
        return digests

    def _insert(self, db: sqlite3.Connection, session_id: int, role: str, content: str, reasoning: str, tokens: int,
                interrupted: bool, now: float) -> int:
        cur = db.execute("INSERT INTO messages(session_id, role, content, reasoning, tokens, created, interrupted) "
                         "VALUES (?,?,?,?,?,?,?)", (session_id, role, content, reasoning, tokens, now, interrupted))
        db.execute("UPDATE sessions SET updated=? WHERE id=?", (now, session_id))
        if role == "user":  # the first user message names a session that still has the default title
            db.execute("UPDATE sessions SET title=? WHERE id=? AND title='New chat'", (title_from(content), session_id))
        return cur.lastrowid

    def add(self, session_id: int, role: str, content: str, reasoning: str = "", tokens: int = 0,
            interrupted: bool = False) -> int:
        with self._transaction() as db:
            return self._insert(db, session_id, role, content, reasoning, tokens, interrupted, time.time())

    def add_turn(self, session_id: int, text: str, images: list[bytes] = (), names: list[str] = ()) -> tuple[int, int]:
        """A user message (with its images and videos, and their files' names where given) and its reply's row
        (empty, interrupted until `update` says it finished), in one transaction: a process killed at any point
        leaves the turn whole, never a user message alone (whose next turn would make two in a row). Returns (user
        message id, reply id)."""
        digests = self._store_images(list(images))  # files first: a row never names a file not yet written
        names = list(names) or [""] * len(digests)
        now = time.time()
        with self._transaction() as db:
            user = self._insert(db, session_id, "user", text, "", 0, False, now)
            db.executemany("INSERT INTO attachments(message_id, position, digest, name) VALUES (?,?,?,?)",
                           [(user, i, d, n) for i, (d, n) in enumerate(zip(digests, names, strict=True))])
            return user, self._insert(db, session_id, "assistant", "", "", 0, True, now)

    def update(self, message_id: int, content: str, reasoning: str = "", tokens: int = 0,
               interrupted: bool = False) -> None:
        self._tx("UPDATE messages SET content=?, reasoning=?, tokens=?, interrupted=? WHERE id=?",
                 (content, reasoning, tokens, interrupted, message_id))

    def delete_message(self, message_id: int) -> None:
        self._tx("DELETE FROM messages WHERE id=?", (message_id,))


@dataclass
class StreamedReply:
    """A reply streaming into its stored row, for the app and the line chat alike: what came so far, and how it
    ended (its "done" event, None while it streams or when it was cut off)."""

    store: SessionStore
    message_id: int
    tokens: int = 0
    tok_s: float = 0.0
    final: ReplyEvent | None = None
    _text: list[str] = field(default_factory=list, repr=False)
    _reasoning: list[str] = field(default_factory=list, repr=False)

    @property
    def text(self) -> str:
        return "".join(self._text)

    @property
    def reasoning(self) -> str:
        return "".join(self._reasoning)

    @property
    def interrupted(self) -> bool:
        """Stopped, failed or cut off before its end."""
        return self.final is None or self.final.finish_reason == "cancelled"

    def follow(self, reply: Reply, show: Callable[[ReplyEvent], None]) -> None:
        """Read `reply` to its end, passing each event to `show`. The row is saved from the first piece, then
        every SAVE_EVERY_S (marked interrupted), and once more however the reading ends: interrupted unless it
        finished. A reply left before its end (an error, Ctrl+C) is closed, so that the engine frees its slot."""
        last_save = 0.0
        try:
            for ev in reply:
                if ev.kind == "text":
                    self._text.append(ev.text)
                elif ev.kind == "reasoning":
                    self._reasoning.append(ev.text)
                elif ev.kind == "done":
                    self.final = ev
                self.tokens, self.tok_s = ev.completion_tokens or self.tokens, ev.tok_s or self.tok_s
                show(ev)
                now = time.monotonic()
                if ev.kind != "done" and now - last_save >= SAVE_EVERY_S:
                    last_save = now
                    self.save()
        finally:
            if self.final is None:
                reply.close()
            self.save()

    def save(self) -> None:
        self.store.update(self.message_id, self.text, self.reasoning, self.tokens, interrupted=self.interrupted)
