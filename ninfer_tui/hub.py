"""A client of the Hugging Face hub's HTTP API for `ninfer pull`: lists a repository's files with the hashes the hub
publishes, downloads them in parallel Range pieces with resume, and checks every file's hash before it takes its name.

Only the standard library (urllib and threads). huggingface_hub would bring its own cache layout and the Xet
protocol (which a loopback test cannot serve), and it does not check a downloaded file's SHA-256; a pull needs no
more than the hub's plain HTTP API: the tree listing and `resolve` URLs that honour Range."""
from __future__ import annotations

import concurrent.futures as cf
import fnmatch
import hashlib
import http.client
import json
import os
import re
import shutil
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath

from engine.errors import UserError

from .progress import Progress, size_text

DEFAULT_ENDPOINT = "https://huggingface.co"
PIECE_BYTES = 64 << 20  # one Range request: the unit of parallel work and of resume
WORKERS = 8  # requests in flight: one stream seldom fills a fast link, and the hub's CDN serves ranges in parallel
RETRIES = 5  # attempts in a row that fetch nothing before a piece gives up
RETRY_WAIT_S = 1.0  # times the attempt's number
TIMEOUT_S = 60.0  # a connection silent this long counts as dropped
READ_BYTES = 1 << 20
OFFLINE_HINT = "to use models already pulled without the network, pass --offline or set HF_HUB_OFFLINE=1"


def endpoint() -> str:
    """The hub's address: HF_ENDPOINT (a mirror, or a test's loopback server) or huggingface.co."""
    return (os.environ.get("HF_ENDPOINT") or DEFAULT_ENDPOINT).rstrip("/")


def offline_from_env() -> bool:
    """HF_HUB_OFFLINE as huggingface_hub reads it."""
    return os.environ.get("HF_HUB_OFFLINE", "").strip().upper() in ("1", "ON", "YES", "TRUE")


@dataclass(frozen=True)
class RemoteFile:
    """A repository file as the tree listing publishes it."""

    path: str
    size: int
    sha256: str = ""  # LFS files: the SHA-256 of the content
    git_sha1: str = ""  # the others: git's blob id, the SHA-1 of b"blob <size>\0" + content

    @classmethod
    def from_listing(cls, item: dict) -> RemoteFile:
        lfs = item.get("lfs")
        if lfs:
            return cls(item["path"], int(lfs["size"]), sha256=lfs["oid"])
        return cls(item["path"], int(item["size"]), git_sha1=item["oid"])

    @property
    def published(self) -> str:
        return self.sha256 or self.git_sha1

    @property
    def check(self) -> str:
        return "SHA-256" if self.sha256 else "git blob SHA-1"

    def digest(self, path: Path) -> str:
        """The hash of the file at `path`, of the kind the hub published for this one."""
        h = hashlib.sha256() if self.sha256 else hashlib.sha1(b"blob %d\0" % path.stat().st_size)
        with path.open("rb") as f:
            while block := f.read(8 << 20):
                h.update(block)
        return h.hexdigest()

    def matches(self, path: Path) -> bool:
        return path.is_file() and path.stat().st_size == self.size and self.digest(path) == self.published


class _Dropped(Exception):
    """A request that may succeed if tried again: the connection broke, timed out, or the server was busy."""


class _Unreachable(_Dropped):
    """No connection to the server at all."""


def _same_origin(url: str, base: str) -> bool:
    """Whether `url` has the scheme and host of `base` (where the token may go)."""
    a, b = urllib.parse.urlsplit(url), urllib.parse.urlsplit(base)
    return (a.scheme, a.netloc) == (b.scheme, b.netloc)


class _TokenStaysHome(urllib.request.HTTPRedirectHandler):
    """Follows redirects, but sends the token only to the host it was given for: the hub redirects file downloads
    to a CDN whose signed URLs must not receive it (a signed S3 URL refuses a second credential)."""

    def redirect_request(self, req, fp, code, msg, headers, newurl):
        new = super().redirect_request(req, fp, code, msg, headers, newurl)
        if new is not None and not _same_origin(newurl, req.full_url):  # another host, or https down to http
            new.remove_header("Authorization")
        return new


@dataclass(frozen=True)
class Repo:
    """A model repository at one revision on the hub HF_ENDPOINT names, read with HF_TOKEN when it is set."""

    name: str
    revision: str = "main"
    endpoint: str = field(default_factory=endpoint)
    token: str = field(default_factory=lambda: os.environ.get("HF_TOKEN", ""), repr=False)

    def __str__(self) -> str:
        return self.name if self.revision == "main" else f"{self.name}@{self.revision}"

    def file_url(self, path: str) -> str:
        return f"{self.endpoint}/{self.name}/resolve/{urllib.parse.quote(self.revision, safe='')}/" \
               f"{urllib.parse.quote(path)}"

    def files(self, patterns: tuple[str, ...] = ()) -> list[RemoteFile]:
        """The repository's files (those matching `patterns`, when given), with their published hashes."""
        url = f"{self.endpoint}/api/models/{self.name}/tree/{urllib.parse.quote(self.revision, safe='')}" \
              "?recursive=true"
        items: list[dict] = []
        while url:
            body, links = self._listing_page(url)
            items += body
            nxt = re.search(r'<([^>]+)>;\s*rel="next"', links)
            url = nxt.group(1) if nxt else ""
            if url and not _same_origin(url, self.endpoint):  # each page is asked for with the token
                raise UserError(f"{self.endpoint} sent the file listing of {self} on to another host ({url})",
                                hint="check HF_ENDPOINT: it must name a Hugging Face hub or a mirror of its API")
        try:
            files = [RemoteFile.from_listing(i) for i in items if i.get("type") == "file"]
        except (KeyError, TypeError, ValueError, AttributeError):
            raise UserError(f"{self.endpoint} listed {self} in a form ninfer does not read",
                            hint="check HF_ENDPOINT: it must name a Hugging Face hub or a mirror of its API") from None
        if not files:
            raise UserError(f"{self} on {self.endpoint} has no files", hint="check the repository's name")
        for f in files:
            _safe_path(f.path, self)
        for pattern in patterns:
            if not any(fnmatch.fnmatchcase(f.path, pattern) for f in files):
                raise UserError(f"{self} on {self.endpoint} has no file {pattern}",
                                hint="the repository may have renamed it; see its file list on the hub")
        return [f for f in files if not patterns or any(fnmatch.fnmatchcase(f.path, p) for p in patterns)]

    def _listing_page(self, url: str) -> tuple[list, str]:
        attempt = 0
        while True:
            attempt += 1
            try:
                with self.get(url, "") as resp:
                    body = json.loads(resp.read())
                    if not isinstance(body, list):
                        raise ValueError("not a list")
                    return body, resp.headers.get("Link", "")
            except _Unreachable as exc:  # the pull's first request: nothing is in progress to retry for
                raise self.unreachable(exc) from None
            except ValueError:
                raise UserError(f"{self.endpoint} answered the file listing of {self} with something that is not "
                                "a JSON list", hint="check HF_ENDPOINT: it must name a Hugging Face hub or a mirror "
                                "of its API") from None
            except (_Dropped, OSError, http.client.HTTPException) as exc:
                if attempt == RETRIES:
                    raise UserError(f"listing the files of {self} on {self.endpoint} failed {RETRIES} times ({exc})",
                                    hint="try again later; " + OFFLINE_HINT) from None
                time.sleep(RETRY_WAIT_S * attempt)

    def get(self, url: str, path: str, headers: dict | None = None) -> http.client.HTTPResponse:
        """GET `url` (of the repository's file `path`, "" for its listing), redirects followed. An answer a retry
        may cure raises _Dropped; one it cannot, a UserError."""
        req = urllib.request.Request(url, headers=dict(headers or {}))
        if self.token:
            req.add_header("Authorization", f"Bearer {self.token}")
        try:
            return urllib.request.build_opener(_TokenStaysHome).open(req, timeout=TIMEOUT_S)
        except urllib.error.HTTPError as exc:
            exc.close()
            raise self._refusal(exc.code, exc.headers.get("X-Error-Code", ""), path) from None
        except urllib.error.URLError as exc:
            raise _Unreachable(str(exc.reason)) from None
        except (OSError, http.client.HTTPException) as exc:  # the connection broke before the answer
            raise _Dropped(str(exc) or type(exc).__name__) from None

    def _refusal(self, code: int, error_code: str, path: str) -> Exception:
        where = f"{self.endpoint}/{self.name}"
        if code == 429 or code >= 500:
            return _Dropped(f"HTTP {code}")
        if code == 401 and not self.token:
            return UserError(f"{self.endpoint} answered 401 for {self} and HF_TOKEN is not set",
                             hint="the repository is private or gated, or its name is wrong: set HF_TOKEN to an "
                             "access token that can read it (https://huggingface.co/settings/tokens)")
        if code == 401:
            return UserError(f"{self.endpoint} refused HF_TOKEN for {self} (HTTP 401)",
                             hint="check that HF_TOKEN is a valid access token that can read the repository")
        if code == 403:
            return UserError(f"{self.endpoint} denied access to {self} (HTTP 403"
                             + (")" if self.token else ", HF_TOKEN is not set)"),
                             hint=f"accept the model's terms at {where} with your account and set HF_TOKEN to "
                             "a token of that account with read access")
        if code == 404 and error_code == "RevisionNotFound":
            return UserError(f"{self.name} has no revision {self.revision} on {self.endpoint}",
                             hint=f"see the repository's branches and tags at {where}")
        if code == 404 and path and error_code != "RepoNotFound":
            return UserError(f"{self} on {self.endpoint} has no file {path} (HTTP 404)",
                             hint="the repository may have renamed or removed it; run the pull again to list it anew")
        if code == 404:
            return UserError(f"repository {self.name} not found on {self.endpoint} (HTTP 404)",
                             hint="check the name and HF_ENDPOINT")
        return UserError(f"{self.endpoint} answered HTTP {code} for {path or 'the file listing'} of {self}",
                         hint="check HF_ENDPOINT and the repository name")

    def unreachable(self, exc: Exception) -> UserError:
        return UserError(f"cannot reach {self.endpoint} ({exc})",
                         hint="check the network connection (and HF_ENDPOINT, if set); " + OFFLINE_HINT)


def _safe_path(path: str, repo: Repo) -> None:
    """A listed path stays inside the model's folder: a mirror cannot write elsewhere."""
    parts = PurePosixPath(path).parts
    if not parts or PurePosixPath(path).is_absolute() or ".." in parts or "\\" in path:
        raise UserError(f"{repo.endpoint} listed a file of {repo} with a path ninfer will not write: {path!r}",
                        hint="check HF_ENDPOINT: it must name a Hugging Face hub or a mirror of its API")


class _Part:
    """One file on its way into `final`: `<name>.part`, filled piece by piece at the pieces' offsets, and
    `<name>.part.json`, which names the file's size and hash and the pieces written, so that a later pull resumes
    only a part of this very version of the file and never mistakes a half-written file for a finished one."""

    def __init__(self, file: RemoteFile, final: Path) -> None:
        self.file, self.final = file, final
        self.part = final.with_name(final.name + ".part")
        self.state = final.with_name(final.name + ".part.json")
        self.pieces = -(-file.size // PIECE_BYTES)
        self.done: set[int] = set()
        self.complete = False  # the finished file is in place, hash checked
        self._lock = threading.Lock()

    def _key(self) -> dict:
        return {"size": self.file.size, "hash": self.file.published, "piece_bytes": PIECE_BYTES}

    def prepare(self) -> list[int]:
        """The pieces still to fetch. A file already in place is kept if it matches its published hash (a pull
        cut short, or a copy the user put there) and fetched anew if not."""
        if self.final.is_file():
            if self.file.matches(self.final):
                self.complete = True
                self.part.unlink(missing_ok=True)
                self.state.unlink(missing_ok=True)
                return []
            self.final.unlink()
        try:
            saved = json.loads(self.state.read_text())
            if self.part.is_file() and {k: saved.get(k) for k in self._key()} == self._key():
                self.done = {int(i) for i in saved["done"] if 0 <= int(i) < self.pieces}
        except (OSError, ValueError, KeyError, TypeError):
            self.done = set()
        if not self.done:
            self.part.unlink(missing_ok=True)
        self.final.parent.mkdir(parents=True, exist_ok=True)
        self.part.touch()
        os.truncate(self.part, self.file.size)
        return [i for i in range(self.pieces) if i not in self.done]

    def have_bytes(self) -> int:
        if self.complete:
            return self.file.size
        return sum(min(PIECE_BYTES, self.file.size - i * PIECE_BYTES) for i in self.done)

    def written(self, piece: int) -> bool:
        """Records a piece as written; True when it was the file's last."""
        with self._lock:
            self.done.add(piece)
            tmp = self.state.with_name(self.state.name + ".tmp")
            tmp.write_text(json.dumps({**self._key(), "done": sorted(self.done)}))
            os.replace(tmp, self.state)
            return len(self.done) == self.pieces


class _Download:
    """A pull's files fetched by one pool of workers, piece by piece."""

    def __init__(self, repo: Repo, again: str, bar: Progress) -> None:
        self.repo, self.again, self.bar = repo, again, bar
        self.stop = threading.Event()

    def piece(self, part: _Part, i: int) -> None:
        """Fetches one piece into the part, resuming where a dropped connection stopped."""
        start, end = i * PIECE_BYTES, min((i + 1) * PIECE_BYTES, part.file.size)
        pos, failures, url = start, 0, self.repo.file_url(part.file.path)
        while pos < end:
            before = pos
            try:
                with self.repo.get(url, part.file.path, {"Range": f"bytes={pos}-{end - 1}"}) as resp, \
                        part.part.open("r+b") as out:
                    if resp.status != 206 and pos > 0:
                        raise UserError(f"{self.repo.endpoint} does not serve byte ranges (HTTP {resp.status} to a "
                                        "Range request)", hint="ninfer pull needs them to resume and to fetch in "
                                        "parallel: use the hub, or a mirror that serves them")
                    out.seek(pos)
                    while pos < end:
                        if self.stop.is_set():
                            return
                        block = _read(resp, min(READ_BYTES, end - pos))
                        out.write(block)
                        pos += len(block)
                        self.bar.advance(len(block))
            except _Dropped as exc:
                failures = 1 if pos > before else failures + 1  # a try that fetched something starts the count anew
                if failures >= RETRIES:
                    raise self._gave_up(part, exc) from None
                time.sleep(RETRY_WAIT_S * failures)
        if part.written(i):
            self.finish(part)

    def finish(self, part: _Part) -> None:
        """The file takes its name only once its hash matches what the hub published; a damaged one is deleted."""
        f = part.file
        got = f.digest(part.part)
        if part.part.stat().st_size != f.size or got != f.published:
            part.part.unlink(missing_ok=True)
            part.state.unlink(missing_ok=True)
            raise UserError(f"{f.path} of {self.repo} failed its {f.check} check (got {got[:16]}..., the hub "
                            f"published {f.published[:16]}...), so it was deleted",
                            hint=f"it was damaged on its way, or the server sent another version; run `{self.again}` "
                            "to download it again")
        os.replace(part.part, part.final)
        part.state.unlink(missing_ok=True)
        part.complete = True

    def _gave_up(self, part: _Part, exc: _Dropped) -> UserError:
        if isinstance(exc, _Unreachable):
            return self.repo.unreachable(exc)
        kept = part.have_bytes()
        return UserError(f"downloading {part.file.path} of {self.repo} failed {RETRIES} times in a row ({exc}); "
                         f"{size_text(kept)} of it {'is' if kept == 1 else 'are'} kept in {part.part.name}",
                         hint=f"run `{self.again}` again to resume")


def _read(resp: http.client.HTTPResponse, n: int) -> bytes:
    """Up to `n` bytes of a body; an early end (which http.client reports as an empty read) counts as dropped."""
    try:
        block = resp.read(n)
    except (OSError, http.client.HTTPException) as exc:
        raise _Dropped(str(exc) or type(exc).__name__) from None
    if not block:
        raise _Dropped("the connection closed before the end of the file")
    return block


def download(repo: Repo, files: list[RemoteFile], folder: Path, again: str, quiet: bool = False) -> None:
    """Every file into `folder` at its repository path, each hash checked. Files already there that match are
    kept, a part left by an earlier pull of the same file version is resumed; anything that goes wrong raises a
    UserError and leaves only parts (with what resuming them needs) behind. `again` is the command to suggest."""
    parts = [_Part(f, folder / f.path) for f in files]
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with cf.ThreadPoolExecutor(WORKERS, thread_name_prefix="pull") as pool:
            todo = list(pool.map(_Part.prepare, parts))  # hashes files already in place, in parallel
            have = sum(p.have_bytes() for p in parts)
            need = sum(p.file.size for p in parts) - have
            free = shutil.disk_usage(folder).free
            if need > free:
                raise UserError(f"{folder} has {size_text(free)} free and the download needs {size_text(need)} more",
                                hint="free some space, or move the models cache with NINFER_MODELS_DIR")
            bar = Progress(f"pulling {repo}", have + need, enabled=not quiet, sizes=True, done=have)
            run = _Download(repo, again, bar)
            jobs = []
            for p, pieces in zip(parts, todo, strict=True):  # pieces in file order: a file finishes early
                jobs += [pool.submit(run.piece, p, i) for i in pieces]
                if not pieces and not p.complete:  # all written by an earlier pull, or an empty file
                    jobs.append(pool.submit(run.finish, p))
            try:
                for job in cf.as_completed(jobs):
                    job.result()
            except BaseException:
                run.stop.set()  # the running pieces stop at their next read; their parts stay for a resume
                for job in jobs:
                    job.cancel()
                raise
            finally:
                bar.close()
    except OSError as exc:  # the network's errors are turned into _Dropped where they happen: this is the disk
        raise UserError(f"cannot write the download into {folder}: {exc.strerror or exc}",
                        hint="check the folder's permissions and free space, or move the models cache with "
                        "NINFER_MODELS_DIR") from None


def verify(files: list[RemoteFile], folder: Path, again: str) -> None:
    """Offline check of a pulled folder against the hashes recorded when it was pulled: a file that does not match
    is deleted and reported."""
    with cf.ThreadPoolExecutor(WORKERS, thread_name_prefix="verify") as pool:
        ok = list(pool.map(lambda f: f.matches(folder / f.path), files))
    bad = [f for f, good in zip(files, ok, strict=True) if not good]
    for f in bad:
        (folder / f.path).unlink(missing_ok=True)
    if bad:
        names = ", ".join(f.path for f in bad[:3]) + (f" and {len(bad) - 3} more" if len(bad) > 3 else "")
        raise UserError(f"{folder}: {names} {'is' if len(bad) == 1 else 'are'} missing or failed the hash check "
                        "recorded when it was pulled (a damaged file was deleted)",
                        hint=f"run `{again}` with the network (HF_HUB_OFFLINE unset) to download what is missing")
