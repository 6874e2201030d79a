import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="session")
def default_model_path() -> str:
    from ninfer_tui.models import resolve

    return resolve("smollm2-135m", announce=False)


@pytest.fixture(scope="session")
def default_engine(default_model_path):
    from engine import Engine, EngineConfig

    return Engine(EngineConfig(model=default_model_path, device="cpu", dtype="float32"))


def run_cli(*args: str, stdin: str | None = None, env: dict | None = None, timeout: int = 300):
    import subprocess

    full_env = {**os.environ, **(env or {})}
    return subprocess.run([sys.executable, "-m", "ninfer_tui.cli", *args], input=stdin, capture_output=True,
                          text=True, env=full_env, timeout=timeout, cwd=ROOT)
