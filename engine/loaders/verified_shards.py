"""Which shards of converted folders had their SHA-256 checked, so that a later load of an unchanged shard need not
hash it again: a small JSON file (`EngineConfig.verified_shards`; the front end gives one in its state dir).

An entry says: the shard at this path, in this state of its file (size, mtime and ctime in ns, inode, device),
matched its SHA-256 in the folder's manifest of this digest, hashed in full. A load skips the hash only where the
open file's state and the manifest's digest both equal the entry's: a file written, touched, replaced or copied
since, or a folder whose manifest changed (converted again, edited), is hashed again. The ctime counts because no
tool sets it back: content changed with its mtime restored (`cp -p`, `rsync`, `touch -r`) still shows.

A file's timestamps tick coarsely (a clock tick, or seconds on some file systems), so a write just after the state
was taken could leave it unchanged: as git does with its index, a shard changed less than `SETTLED_NS` before its
hash began is not recorded, nor one whose state differs after the hash from before it.

The record is a cache: an unreadable one counts as empty, one that cannot be written leaves the next load hashing,
and entries whose files changed or went are dropped whenever it is written."""
from __future__ import annotations

import hashlib
import json
import os
import threading
from dataclasses import asdict, dataclass
from pathlib import Path

from .manifest import Manifest

SETTLED_NS = 1_000_000_000
_VERSION = 1


@dataclass(frozen=True)
class FileState:
    size: int
    mtime_ns: int
    ctime_ns: int
    inode: int
    device: int

    @classmethod
    def of(cls, st: os.stat_result) -> FileState:
        return cls(st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino, st.st_dev)


def manifest_digest(m: Manifest) -> str:
    """The SHA-256 of the manifest as it was read (every shard's hash among it)."""
    return hashlib.sha256(json.dumps(m.to_json(), sort_keys=True).encode()).hexdigest()


def _read(path: Path) -> dict[str, dict]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return {}
    if not isinstance(data, dict) or data.get("version") != _VERSION or not isinstance(data.get("shards"), dict):
        return {}
    return {k: e for k, e in data["shards"].items() if isinstance(e, dict)}


def _unchanged(path: str, entry: dict) -> bool:
    try:
        state = asdict(FileState.of(os.stat(path)))
    except OSError:
        return False
    return all(entry.get(k) == v for k, v in state.items())


class VerifiedShards:
    """The record at `path` as it concerns one folder read with the manifest `m`. `known` and `hashed` are called
    from the loader's worker threads; `save` once the load has read its shards."""

    def __init__(self, path: Path, folder: Path, m: Manifest) -> None:
        self.path = path
        self._folder = folder.resolve()
        self._digest = manifest_digest(m)
        self._entries = _read(path)
        self._new: dict[str, dict] = {}
        self._lock = threading.Lock()

    def _entry(self, state: FileState) -> dict:
        return {"manifest": self._digest, **asdict(state)}

    def known(self, name: str, state: FileState) -> bool:
        """Whether the shard `name`, its file now in `state`, was verified in this state for this manifest."""
        return self._entries.get(str(self._folder / name)) == self._entry(state)

    def hashed(self, name: str, before: FileState, after: FileState, began_ns: int) -> None:
        """The shard `name` matched its SHA-256, read from `began_ns` (time.time_ns()) with its file in `before`
        and in `after` when the hash ended: recorded if the file was settled and did not change meanwhile."""
        if after != before or max(before.mtime_ns, before.ctime_ns) > began_ns - SETTLED_NS:
            return
        with self._lock:
            self._new[str(self._folder / name)] = self._entry(before)

    def save(self) -> None:
        """Write the shards hashed by this load into the record as it is now on disk (another process may have
        written it meanwhile), replacing the file whole so that a reader never sees half of it."""
        with self._lock:
            new = dict(self._new)
        if not new:
            return
        entries = {k: e for k, e in {**_read(self.path), **new}.items() if _unchanged(k, e)}
        tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}-{threading.get_ident()}")
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp.write_text(json.dumps({"version": _VERSION, "shards": entries}, indent=1) + "\n", encoding="utf-8")
            os.replace(tmp, self.path)
        except OSError:  # a state dir that cannot be written costs the next load its hashes, nothing else
            tmp.unlink(missing_ok=True)
