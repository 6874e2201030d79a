"""The disk tier of held conversations: a held conversation that leaves memory (evicted from the held set, or
still held when the engine closes) is written to a file, and a later prompt that continues it (after a restart,
or in an engine of another profile with the same model and formats) loads it back instead of prefilling it again.

A file is safetensors (tensors and string metadata, no code): the tokens, the KV rows of every store of the pool,
the recurrent state and its checkpoints, and in the metadata the engine's identity (model, compute dtype, weight
formats, KV stores, recurrent-state shapes) and a CRC-32 of every tensor. A file of another identity is left
alone (another engine may use it); one that fails to read or check is logged, deleted and never loaded. Files are
written whole under a temporary name and renamed; the folder stays within its cap by deleting the least recently
used files. Writes run on a thread of their own (the engine only copies the conversation to host memory, and at
most PENDING_WRITES wait for the disk), and so do reads (`read`): a request waits for its file before it is
admitted, while the engine core's step loop goes on."""
from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import queue
import threading
import zlib
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from .held import reusable
from .kv_cache import HostKV
from .kv_pool import KVPool
from .state_slots import GDNState

log = logging.getLogger("ninfer.engine")
SUFFIX = ".safetensors"
VERSION = 1
# Conversations copied to host memory and waiting for the writer: evictions faster than the disk takes them are
# dropped past this (their pinned copies would otherwise pile up in RAM).
PENDING_WRITES = 2


# a file's conversation in host memory: tokens, KV, recurrent state, checkpoints
Loaded = tuple[list[int], HostKV, GDNState | None, dict[int, GDNState]]


@dataclass(frozen=True)
class DiskEntry:
    """A file of this engine's identity, as the index knows it without reading its tensors."""

    path: Path
    tokens: tuple[int, ...]
    checkpoints: tuple[int, ...]
    recurrent: bool  # it has a recurrent state (a hybrid model's)


@dataclass
class Spilled:
    """A held conversation's parts in host memory, on their way to a file."""

    tokens: list[int]
    kv: HostKV
    states: GDNState | None
    checkpoints: dict[int, GDNState]
    ready: torch.cuda.Event | None  # the device-to-host copies' end (None on the CPU)


def identity(model_name: str, model, weights: dict[str, str], pool: KVPool) -> dict:
    """What must be equal for a file's KV and states to be this engine's: the model, how it computes, how its
    weights are stored (quantized weights make other activations), the KV stores and the recurrent state."""
    stores = {key: [s.spec.layers, s.spec.heads, s.spec.dim, s.spec.kv_dtype, str(s.spec.compute_dtype)]
              for key, s in sorted(pool.stores.items())}
    states = None
    if getattr(model, "linear_index", None):
        s = model.geometry
        states = {"conv": [len(model.linear_index), s.linear_conv_kernel - 1, model.conv_dim, str(model.dtype)],
                  "recurrent": [len(model.linear_index), s.linear_num_value_heads, s.linear_key_head_dim,
                                s.linear_value_head_dim, str(torch.promote_types(model.dtype, torch.float32))]}
    return {"version": VERSION, "model": model_name, "files": _fingerprint(model_name), "dtype": str(model.dtype),
            "weights": weights, "stores": stores, "states": states}


def _fingerprint(model_name: str) -> list:
    """The model's files as (name, size, modification time): a folder converted again under the same path is
    another model."""
    path = Path(model_name)
    if not path.exists():  # synthetic:PRESET, whose weights the name fixes
        return []
    files = sorted(p for p in path.iterdir() if p.is_file()) if path.is_dir() else [path]
    return [[p.name, p.stat().st_size, p.stat().st_mtime_ns] for p in files]


def open_disk_tier(folder: str, mib: int, model_name: str, model, weights: dict[str, str], pool: KVPool
                   ) -> DiskTier | None:
    """The disk tier in `folder` with a cap of `mib` MiB (None when off: no folder or no cap, or the folder cannot
    be made, which is logged: the engine runs without it)."""
    if not folder or mib <= 0:
        return None
    try:
        return DiskTier(Path(folder), mib << 20, identity(model_name, model, weights, pool), pool)
    except OSError as exc:
        log.warning("the disk tier of held conversations is off: %s", exc)
        return None


class DiskTier:
    def __init__(self, folder: Path, cap_bytes: int, ident: dict, pool: KVPool) -> None:
        self.folder, self.cap = folder, cap_bytes
        self.identity = json.dumps(ident, sort_keys=True)
        self._ident = ident
        self._specs = {key: store.spec for key, store in pool.stores.items()}
        self._lock = threading.Lock()  # the index (the writer thread adds to it)
        self._entries: list[DiskEntry] = []
        self._queue: queue.Queue[Spilled | None] = queue.Queue(PENDING_WRITES)  # None: the writer stops
        self._writer: threading.Thread | None = None
        self._reader = ThreadPoolExecutor(1, thread_name_prefix="ninfer-disk-read")
        self._closed = False
        folder.mkdir(parents=True, exist_ok=True)
        for path in sorted(folder.glob("*" + SUFFIX)):
            entry = self._read_index(path)
            if entry is not None:
                self._entries.append(entry)

    # ---- finding and loading ------------------------------------------------------------------------------

    def best(self, prompt: list[int]) -> tuple[DiskEntry | None, int]:
        """The file that serves the most of `prompt`, and how many tokens (None, 0: none serves any)."""
        with self._lock:
            entries = list(self._entries)
        best, best_n = None, 0
        for entry in entries:
            n = reusable(entry.tokens, entry.checkpoints, entry.recurrent, prompt)
            if n > best_n:
                best, best_n = entry, n
        return best, best_n

    def read(self, prompt: list[int], served: Callable[[], int]) -> Future | None:
        """On the reader thread, `load` the file that serves the most of `prompt` if it serves more than
        `served()` tokens (what memory serves, asked there as well): a future of `load`'s result, or of None when
        no file serves more; it never raises. None when the tier is closed or no file serves any of `prompt` (the
        index is in memory: a request no file serves never waits behind another's read)."""
        if self._closed:
            return None
        entry, n = self.best(prompt)
        if entry is None:
            return None
        try:
            return self._reader.submit(self._read, prompt, entry, n, served)
        except RuntimeError:  # the tier closed meanwhile (the engine, or the interpreter, is shutting down)
            return None

    def _read(self, prompt: list[int], entry: DiskEntry, n: int, served: Callable[[], int]) -> Loaded | None:
        """`read`'s work, with the file it found: the index is scanned again only where that file left it since
        (superseded by a longer conversation's, or removed for the cap)."""
        try:
            in_memory = served()
            if in_memory >= len(prompt) - 1:  # a file serves all but the prompt's last token at most
                return None
            if not any(e is entry for e in self._snapshot()):
                entry, n = self.best(prompt)
            return self.load(entry) if n > in_memory else None
        except Exception as exc:  # noqa: BLE001 - a file not loaded is only a longer prefill
            log.warning("reading a held conversation from %s failed: %s", self.folder, exc)
            return None

    def load(self, entry: DiskEntry) -> Loaded | None:
        """A file's conversation in host memory: tokens, KV, recurrent state, checkpoints; None (the file logged
        and deleted) when it does not read back as written."""
        try:
            with safe_open(entry.path, framework="pt") as f:
                meta = f.metadata() or {}
                if meta.get("ninfer") != self.identity:
                    raise ValueError("its identity changed since it was indexed")
                sums, views = json.loads(meta["crc32"]), json.loads(meta["views"])
                tensors = {}
                for name in f.keys():
                    t = f.get_tensor(name)
                    if zlib.crc32(_raw(t)) != sums.get(name):
                        raise ValueError(f"tensor {name} fails its checksum")
                    tensors[name] = t.view(getattr(torch, views[name])) if name in views else t
            loaded = self._assemble(entry, tensors)
        except FileNotFoundError:  # the writer evicted it for the cap since it was found
            self._discard(entry)
            return None
        except Exception as exc:  # noqa: BLE001 - a bad file is skipped, never the request's failure
            log.warning("ignoring held conversation file %s: %s", entry.path, exc)
            self._discard(entry)
            return None
        with contextlib.suppress(OSError):  # the eviction order is use, not writing; a file gone since is fine
            os.utime(entry.path)
        return loaded

    def _assemble(self, entry: DiskEntry, tensors: dict[str, torch.Tensor]) -> Loaded:
        tokens = tensors.pop("tokens").tolist()
        if tuple(tokens) != entry.tokens:
            raise ValueError("its tokens changed since it was indexed")
        rows: dict[str, dict[str, torch.Tensor]] = {}
        for key, spec in self._specs.items():
            rows[key] = {}
            for name in ("k", "v", "k_scale", "v_scale") if spec.kv_dtype in ("int8", "fp8") else ("k", "v"):
                t = tensors.pop(f"kv.{key}.{name}")
                want = (spec.layers, len(tokens), spec.heads) + ((spec.dim,) if name in ("k", "v") else ())
                if tuple(t.shape) != want:
                    raise ValueError(f"KV {key}.{name} is {tuple(t.shape)}, expected {want}")
                rows[key][name] = t
        states, checkpoints = None, {}
        if entry.recurrent:
            states = self._state(tensors, "state")
            checkpoints = {pos: self._state(tensors, f"checkpoint.{pos}") for pos in entry.checkpoints}
        if tensors:
            raise ValueError(f"unexpected tensors {sorted(tensors)[:3]}")
        return tokens, HostKV.from_rows(self._specs, rows), states, checkpoints

    def _state(self, tensors: dict[str, torch.Tensor], prefix: str) -> GDNState:
        shapes = self._ident["states"]
        state = GDNState(tensors.pop(prefix + ".conv"), tensors.pop(prefix + ".recurrent"))
        for name in ("conv", "recurrent"):
            t, want = getattr(state, name), shapes[name]
            if list(t.shape) != want[:-1] or str(t.dtype) != want[-1]:
                raise ValueError(f"{prefix}.{name} is {tuple(t.shape)} {t.dtype}, expected {want}")
        return state

    def forget(self) -> None:
        """Stop serving the files written so far (they stay for other engines and later runs)."""
        with self._lock:
            self._entries.clear()

    # ---- writing ------------------------------------------------------------------------------------------

    def spill(self, tokens: list[int], cache, checkpoints: dict[int, GDNState], wait: bool = False) -> None:
        """Write a held conversation (its first `cache.length` tokens) to a file, unless a file already holds it
        or more of it, or it alone exceeds the cap: its KV and states are copied to host memory now (the caller
        may then give its blocks back), the file is written by the writer thread. With PENDING_WRITES already
        waiting it is not written (logged), unless `wait`: then it waits for room. A failure is logged, never
        raised; the conversation's blocks are the caller's either way."""
        try:
            if self._closed or any(e.tokens[:len(tokens)] == tuple(tokens) for e in self._snapshot()):
                return
            size = _file_bytes(cache, checkpoints)
            if size > self.cap:
                log.info("a held conversation of %d tokens (%d MiB) exceeds the disk tier's cap: not written",
                         cache.length, size >> 20)
                return
            if not wait and self._queue.full():  # spills come one at a time (under the engine's lock)
                log.info("a held conversation of %d tokens was not written: %d wait for the disk already",
                         cache.length, PENDING_WRITES)
                return
            kv = cache.kv if isinstance(cache.kv, HostKV) else HostKV(cache.kv.table, cache.length)
            states = cache.states.snapshot(host=True) if cache.states is not None else None
            kept = {pos: s.snapshot(host=True) for pos, s in checkpoints.items()} if states is not None else {}
            ready = None
            if torch.cuda.is_initialized():  # the copies above are queued on the device's stream
                ready = torch.cuda.Event()
                ready.record()
            if self._writer is None:  # before the put: a queued item with no writer would hang `flush`
                writer = threading.Thread(target=self._write_loop, name="ninfer-disk-tier", daemon=True)
                writer.start()  # raises at interpreter shutdown (Python 3.12): nothing was queued then
                self._writer = writer
            self._queue.put(Spilled(list(tokens), kv, states, kept, ready))  # room: only the writer takes
        except Exception as exc:  # noqa: BLE001 - a conversation not written is only a slower next turn
            log.warning("a held conversation was not written to the disk tier: %s", exc)

    def flush(self) -> None:
        """Wait until every conversation handed to `spill` is written."""
        self._queue.join()

    def close(self) -> None:
        """Stop the threads (the engine closes): the conversations handed to `spill` so far are written first,
        none dropped (the engine has handed over those it holds), and a read under way ends (one not begun is
        dropped: its request was cancelled with the engine). Later spills and reads do nothing."""
        if self._closed:
            return
        self._closed = True
        self._reader.shutdown(wait=True, cancel_futures=True)
        if self._writer is not None:
            self._queue.put(None)  # behind every queued conversation
            self._writer.join()
            self._writer = None

    def _write_loop(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                self._queue.task_done()
                return
            try:
                self._write(item)
            except Exception as exc:  # noqa: BLE001 - a full disk or a removed folder: the conversation is not kept
                log.warning("writing a held conversation to %s failed: %s", self.folder, exc)
            finally:
                self._queue.task_done()

    def _write(self, item: Spilled) -> None:
        if item.ready is not None:
            item.ready.synchronize()
        tensors = {"tokens": torch.tensor(item.tokens, dtype=torch.int64)}
        for key, rows in item.kv.rows.items():
            for name, t in rows.items():
                tensors[f"kv.{key}.{name}"] = t
        if item.states is not None:
            for prefix, state in [("state", item.states),
                                  *((f"checkpoint.{pos}", s) for pos, s in item.checkpoints.items())]:
                tensors[prefix + ".conv"], tensors[prefix + ".recurrent"] = state.conv, state.recurrent
        views = {name: str(t.dtype).removeprefix("torch.") for name, t in tensors.items()
                 if t.dtype == torch.float8_e4m3fn}
        tensors = {name: (t.view(torch.uint8) if name in views else t).contiguous() for name, t in tensors.items()}
        meta = {"ninfer": self.identity, "views": json.dumps(views),
                "crc32": json.dumps({name: zlib.crc32(_raw(t)) for name, t in tensors.items()}),
                "checkpoints": json.dumps(sorted(item.checkpoints))}
        name = hashlib.sha256(self.identity.encode() + tensors["tokens"].numpy().tobytes()).hexdigest()[:24]
        path = self.folder / (name + SUFFIX)
        tmp = self.folder / f".{name}.{os.getpid()}.tmp"
        try:
            save_file(tensors, tmp, metadata=meta)
            os.replace(tmp, path)
        finally:
            tmp.unlink(missing_ok=True)
        entry = DiskEntry(path, tuple(item.tokens), tuple(sorted(item.checkpoints)), item.states is not None)
        with self._lock:
            # a file whose conversation this one continues is superseded by it
            gone = [e for e in self._entries if e.path == path or entry.tokens[:len(e.tokens)] == e.tokens]
            self._entries = [e for e in self._entries if e not in gone] + [entry]
        for e in gone:
            if e.path != path:
                e.path.unlink(missing_ok=True)
        self._enforce_cap()

    def _enforce_cap(self) -> None:
        """Delete the least recently used files (any engine's) while the folder exceeds the cap."""
        files = []
        for path in self.folder.glob("*" + SUFFIX):
            try:
                stat = path.stat()
            except FileNotFoundError:  # another engine deleted it meanwhile
                continue
            files.append((stat.st_mtime, stat.st_size, path))
        total = sum(size for _, size, _ in files)
        for _, size, path in sorted(files):
            if total <= self.cap:
                break
            path.unlink(missing_ok=True)
            total -= size
            with self._lock:
                self._entries = [e for e in self._entries if e.path != path]

    # ---- the index ----------------------------------------------------------------------------------------

    def _snapshot(self) -> list[DiskEntry]:
        with self._lock:
            return list(self._entries)

    def _read_index(self, path: Path) -> DiskEntry | None:
        """A file's index entry, from its metadata and tokens; None for another engine's file (kept) or a file
        that cannot be read (logged and deleted)."""
        entry = DiskEntry(path, (), (), False)
        try:
            with safe_open(path, framework="pt") as f:
                meta = f.metadata() or {}
                if meta.get("ninfer") != self.identity:
                    return None
                tokens = tuple(f.get_tensor("tokens").tolist())
                recurrent = "state.recurrent" in f.keys()
            return DiskEntry(path, tokens, tuple(json.loads(meta["checkpoints"])), recurrent)
        except Exception as exc:  # noqa: BLE001 - a bad file is skipped
            log.warning("ignoring held conversation file %s: %s", path, exc)
            self._discard(entry)
            return None

    def _discard(self, entry: DiskEntry) -> None:
        with self._lock:
            self._entries = [e for e in self._entries if e.path != entry.path]
        entry.path.unlink(missing_ok=True)


def _file_bytes(cache, checkpoints: dict[int, GDNState]) -> int:
    """The bytes of a held conversation's tensors in its file (tokens, KV rows, states), from their shapes: known
    before anything is copied to host memory."""
    n = cache.length
    if isinstance(cache.kv, HostKV):
        kv = cache.kv.nbytes
    else:
        kv = n * sum(store.bytes_per_row for store in cache.kv.table.pool.stores.values())
    states = 0
    if cache.states is not None:
        states = (1 + len(checkpoints)) * (cache.states.conv.nbytes + cache.states.recurrent.nbytes)
    return 8 * n + kv + states


def _raw(t: torch.Tensor) -> memoryview:
    """A CPU tensor's bytes, for the checksum."""
    return memoryview(t.contiguous().view(torch.uint8).numpy()).cast("B")
