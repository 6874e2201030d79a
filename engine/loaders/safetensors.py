"""HF model folders: config.json + (sharded) safetensors, read lazily one tensor at a time."""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open

from ..errors import ModelFormatError
from ..models.spec import ModelSpec, spec_from_hf_config
from ..tokenizer.hf_folder import tokenizer_from_folder
from . import LoadedModel, hf_config

# Prefixes transformers uses, longest first: the multimodal wrapper nests the text model one level deeper.
_PREFIXES = ("model.language_model.", "model.")
_SKIP = ("model.visual.", "visual.")  # the vision tower is not loaded (text-only engine for now)


def canonical_name(name: str) -> str | None:
    if name.startswith(_SKIP):
        return None
    for prefix in _PREFIXES:
        if name.startswith(prefix):
            return name[len(prefix):]
    return name  # lm_head.weight, mtp.*


def shard_files(folder: Path) -> list[Path]:
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as exc:
            raise ModelFormatError(f"{index} is not a valid safetensors index: {exc}") from None
        files = [folder / f for f in sorted(set(weight_map.values()))]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise ModelFormatError(f"{folder}: missing shard {missing[0]} (listed in model.safetensors.index.json)",
                                   hint="download the complete model folder")
        return files
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ModelFormatError(f"{folder} has no *.safetensors files", hint="give a complete HF model folder")
    return files


def folder_spec(folder: Path) -> ModelSpec:
    """The ModelSpec of a HF folder, from its config.json alone."""
    return spec_from_hf_config(hf_config(folder))


def load_hf_folder(folder: Path, dtype: torch.dtype, device: torch.device, transform=None) -> LoadedModel:
    spec = folder_spec(folder)
    weights = read_tensors(folder, dtype, device, transform)
    tokenizer, template = tokenizer_from_folder(folder, spec)
    return LoadedModel(spec, weights, tokenizer, template, str(folder))


def read_tensors(folder: Path, dtype: torch.dtype, device: torch.device, transform=None) -> dict[str, torch.Tensor]:
    """Every tensor of a folder's safetensors under its canonical name, converted one at a time."""
    weights: dict[str, torch.Tensor] = {}
    for shard in shard_files(folder):
        try:
            handle = safe_open(str(shard), framework="pt", device="cpu")
        except Exception as exc:
            raise ModelFormatError(f"{shard.name} is not a readable safetensors file: {exc}") from None
        with handle as f:
            for name in f.keys():
                canon = canonical_name(name)
                if canon is None:
                    continue
                t = f.get_tensor(name)
                # Decay parameters stay fp32: exp(A_log) in bf16 would lose the decay rates' precision.
                keep = torch.promote_types(dtype, torch.float32) if canon.endswith(("A_log", "dt_bias")) else dtype
                t = t.to(device=device, dtype=keep)
                weights[canon] = transform(canon, t) if transform else t
    return weights
