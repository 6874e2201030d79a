"""Loaders: turn a model reference into named tensors, a ModelSpec, a tokenizer and a chat template."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from ..errors import ModelFormatError
from ..models.spec import ModelSpec
from ..tokenizer import Tokenizer


@dataclass
class LoadedModel:
    spec: ModelSpec
    weights: dict[str, torch.Tensor]  # canonical (HF-style, no "model." prefix) names
    tokenizer: Tokenizer
    chat_template: str | None
    source: str


def load_model(ref: str, dtype: torch.dtype, device: torch.device) -> LoadedModel:
    """Load a `.gguf` file, a HF folder, or `synthetic:PRESET`."""
    if ref.startswith("synthetic:"):
        from .synthetic import load_synthetic

        return load_synthetic(ref.split(":", 1)[1], dtype, device)
    path = Path(ref).expanduser()
    if not path.exists():
        raise ModelFormatError(
            f"model path {str(path)!r} does not exist",
            hint="give a registry name (see `ninfer models`), a .gguf file, or a HF model folder",
        )
    if path.is_dir():
        from .safetensors import load_hf_folder

        return load_hf_folder(path, dtype, device)
    with path.open("rb") as f:
        magic = f.read(4)
    if magic == b"GGUF":
        from .gguf import load_gguf

        return load_gguf(path, dtype, device)
    raise ModelFormatError(
        f"{str(path)!r} is neither a GGUF file nor a HF model folder",
        hint="give a .gguf file, or a folder with config.json and *.safetensors",
    )
