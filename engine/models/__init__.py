"""Model definitions: the geometry (`ModelSpec`), and thin torch compositions of layers."""
from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ..loaders import LoadedModel
    from .spec import ModelSpec


def model_class(spec: ModelSpec):
    """The model class for a geometry's architecture."""
    if spec.arch == "llama":
        from .llama import LlamaModel

        return LlamaModel
    if spec.arch == "qwen3_5":
        from .qwen3_5 import Qwen35Model

        return Qwen35Model
    raise AssertionError(f"unknown arch {spec.arch!r}")


def weight_shapes(spec: ModelSpec) -> dict[str, tuple[int, ...]]:
    return model_class(spec).weight_shapes(spec)


def fused_weights(spec: ModelSpec) -> tuple[tuple[str, ...], ...]:
    """The groups of a layer's weights its model fuses into one, by name after the layer's prefix."""
    return model_class(spec).fused_weights()


def build_model(loaded: LoadedModel, kv_dtype: str):
    return model_class(loaded.geometry)(loaded.geometry, loaded.weights, kv_dtype)
