"""Chat sessions in SQLite (the platformdirs data dir), shared by the TUI and the line chat.

Every change is one transaction and the database runs in WAL mode, so a process killed mid-reply leaves a valid
database holding the reply up to its last saved piece.
"""
from __future__ import annotations

import sqlite3
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from . import paths

SCHEMA = """
CREATE TABLE IF NOT EXISTS sessions (
    id INTEGER PRIMARY KEY, title TEXT NOT NULL, model TEXT NOT NULL DEFAULT '', profile TEXT NOT NULL DEFAULT '',
    created REAL NOT NULL, updated REAL NOT NULL);
CREATE TABLE IF NOT EXISTS messages (
    id INTEGER PRIMARY KEY, session_id INTEGER NOT NULL REFERENCES sessions(id) ON DELETE CASCADE,
    role TEXT NOT NULL, content TEXT NOT NULL, reasoning TEXT NOT NULL DEFAULT '', tokens INTEGER NOT NULL DEFAULT 0,
    created REAL NOT NULL);
CREATE INDEX IF NOT EXISTS messages_by_session ON messages(session_id, id);
"""
TITLE_CHARS = 60


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

    def as_chat(self) -> dict:
        return {"role": self.role, "content": self.content}


def title_from(text: str) -> str:
    line = " ".join(text.split())
    return line if len(line) <= TITLE_CHARS else line[: TITLE_CHARS - 1] + "…"


class SessionStore:
    def __init__(self, path: Path | None = None) -> None:
        self.path = path or paths.data_dir() / "sessions.db"
        self.db = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None, timeout=10)
        self.db.execute("PRAGMA journal_mode=WAL")
        self.db.execute("PRAGMA foreign_keys=ON")
        self.db.executescript(SCHEMA)
        self._lock = threading.RLock()  # the TUI writes from its generation thread and reads from the UI thread

    def close(self) -> None:
        self.db.close()

    def _tx(self, sql: str, args: tuple = ()) -> sqlite3.Cursor:
        with self._lock, self.db:  # one transaction per change
            return self.db.execute(sql, args)

    def _rows(self, sql: str, args: tuple = ()) -> list[tuple]:
        with self._lock:
            return self.db.execute(sql, args).fetchall()

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
        self._tx("DELETE FROM sessions WHERE id=?", (session_id,))

    def messages(self, session_id: int) -> list[Message]:
        rows = self._rows("SELECT id, role, content, reasoning, tokens FROM messages WHERE session_id=? ORDER BY id",
                          (session_id,))
        return [Message(*r) for r in rows]

    def add(self, session_id: int, role: str, content: str, reasoning: str = "", tokens: int = 0) -> int:
        now = time.time()
        with self._lock, self.db:
            cur = self.db.execute("INSERT INTO messages(session_id, role, content, reasoning, tokens, created) "
                                  "VALUES (?,?,?,?,?,?)", (session_id, role, content, reasoning, tokens, now))
            self.db.execute("UPDATE sessions SET updated=? WHERE id=?", (now, session_id))
            if role == "user":  # the first user message names a session that still has the default title
                self.db.execute("UPDATE sessions SET title=? WHERE id=? AND title='New chat'",
                                (title_from(content), session_id))
        return cur.lastrowid

    def update(self, message_id: int, content: str, reasoning: str = "", tokens: int = 0) -> None:
        self._tx("UPDATE messages SET content=?, reasoning=?, tokens=? WHERE id=?",
                 (content, reasoning, tokens, message_id))

    def delete_message(self, message_id: int) -> None:
        self._tx("DELETE FROM messages WHERE id=?", (message_id,))
