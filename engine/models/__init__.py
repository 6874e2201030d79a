"""Model definitions: a spec, and thin torch compositions of layers."""
from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ..loaders import LoadedModel


def build_model(loaded: LoadedModel, kv_dtype: str):
    """The model class for the loaded spec's architecture."""
    if loaded.spec.arch == "llama":
        from .llama import LlamaModel

        return LlamaModel(loaded.spec, loaded.weights, kv_dtype)
    if loaded.spec.arch == "qwen3_5":
        from .qwen3_5 import Qwen35Model

        return Qwen35Model(loaded.spec, loaded.weights, kv_dtype)
    raise AssertionError(f"loader produced unknown arch {loaded.spec.arch!r}")
