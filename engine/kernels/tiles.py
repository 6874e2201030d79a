"""Kernel tiles chosen by timing, kept on disk so the next launch on the same GPU skips the timing (and the
compilation of every losing candidate). One JSON file; an entry's key names the GPU, the Triton version, the
problem and the exact candidate list, so a new driver stack or a changed list times again instead of trusting a
stale choice. The engine sets the file (`EngineConfig.kernel_cache`); without one, choices live per process."""
from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict
from pathlib import Path

_path: Path | None = None
_entries: dict[str, dict] = {}


def use_file(path: str) -> None:
    """Read earlier choices from `path` (a missing or unreadable file is an empty one) and write new ones to it."""
    global _path
    _path = Path(path) if path else None
    _entries.clear()
    if _path is not None and _path.is_file():
        try:
            loaded = json.loads(_path.read_text())
        except (OSError, ValueError):
            loaded = {}
        if isinstance(loaded, dict):
            _entries.update({k: v for k, v in loaded.items() if isinstance(v, dict)})


def key(device: str, problem: str, options: list) -> str:
    import triton

    digest = hashlib.sha1(repr(options).encode()).hexdigest()[:12]
    return f"{device} | triton {triton.__version__} | {problem} | candidates {digest}"


def lookup(k: str, options: list):
    """The stored choice for key k, as the candidate it names (None if absent or not among the options)."""
    entry = _entries.get(k)
    for option in options:
        if entry == asdict(option):
            return option
    return None


def record(k: str, choice) -> None:
    _entries[k] = asdict(choice)
    if _path is None:
        return
    try:
        _path.parent.mkdir(parents=True, exist_ok=True)
        tmp = _path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(_entries, indent=1, sort_keys=True))
        tmp.replace(_path)  # atomic: a second process never reads half a file
    except OSError:
        pass  # a read-only cache dir costs the next launch its timing, nothing else
