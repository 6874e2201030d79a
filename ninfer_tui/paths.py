"""Where ninfer keeps its files (platformdirs, in one place). Each can be moved with an env variable."""
from __future__ import annotations

import os
from pathlib import Path

import platformdirs

APP = "ninfer"


def _dir(env: str, default: str) -> Path:
    path = Path(os.environ.get(env) or default)
    path.mkdir(parents=True, exist_ok=True)
    return path


def config_dir() -> Path:
    """User profiles and settings."""
    return _dir("NINFER_CONFIG_DIR", platformdirs.user_config_dir(APP))


def data_dir() -> Path:
    """Chat sessions."""
    return _dir("NINFER_DATA_DIR", platformdirs.user_data_dir(APP))


def cache_dir() -> Path:
    """Downloaded models."""
    return _dir("NINFER_CACHE_DIR", platformdirs.user_cache_dir(APP))


def state_dir() -> Path:
    """Pidfiles and server logs."""
    return _dir("NINFER_STATE_DIR", platformdirs.user_state_dir(APP))


def models_dir() -> Path:
    return _dir("NINFER_MODELS_DIR", str(cache_dir() / "models"))
