"""HF model folders: config.json + (sharded) safetensors, read lazily one tensor at a time."""
from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import torch
from safetensors import safe_open

from ..errors import ModelFormatError
from ..models.spec import ModelSpec, spec_from_hf_config
from ..tokenizer.hf_folder import tokenizer_from_folder
from . import VISION_PREFIX, LoadedModel, VisionConfig, hf_config, read_json, vision_config

# Prefixes transformers uses, longest first: the multimodal wrapper nests the text model one level deeper.
_PREFIXES = ("model.language_model.", "model.")
_VISION = ("model.visual.", "visual.")  # the vision tower's tensors, kept as "visual.*"


def canonical_name(name: str) -> str:
    for prefix in _VISION:
        if name.startswith(prefix):
            return VISION_PREFIX + name[len(prefix):]
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
    """The ModelSpec of a HF folder, from its config.json and its tensors' names: a vision_config whose tower
    is not among the tensors (a text-only export keeps the config) is a text-only model."""
    spec = spec_from_hf_config(hf_config(folder))
    if spec.vision_params and not has_tower(folder):
        spec = replace(spec, vision_params=0)
    return spec


def has_tower(folder: Path) -> bool:
    """Whether the folder's safetensors hold vision tower tensors (from the index, or the shards' headers)."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        return any(name.startswith(_VISION) for name in read_json(index).get("weight_map", {}))
    return any(name.startswith(_VISION) for shard in shard_files(folder) for name in _opened(shard).keys())


def _opened(shard: Path):
    try:
        return safe_open(str(shard), framework="pt", device="cpu")
    except Exception as exc:
        raise ModelFormatError(f"{shard.name} is not a readable safetensors file: {exc}") from None


def load_hf_folder(folder: Path, dtype: torch.dtype, device: torch.device, transform=None,
                   vision: bool = True) -> LoadedModel:
    """A HF folder's model; its vision tower (where it has one) only with `vision`."""
    spec = folder_spec(folder)
    vision = folder_vision(folder, hf_config(folder)) if vision and spec.vision_params else None
    weights = read_tensors(folder, dtype, device, transform, vision=vision is not None)
    tokenizer, template = tokenizer_from_folder(folder, spec)
    return LoadedModel(spec, weights, tokenizer, template, str(folder), vision)


def folder_vision(folder: Path, config: dict) -> VisionConfig | None:
    """The vision side of a Qwen3.5/3.6 checkpoint (its config's vision_config, the image and video token ids, the
    processor's normalisation and video sampling); None for a text-only one."""
    if "vision_config" not in config or config.get("model_type") != "qwen3_5":
        return None
    processor, video = folder / "preprocessor_config.json", folder / "video_preprocessor_config.json"
    return vision_config(config, read_json(processor) if processor.is_file() else {},
                         read_json(video) if video.is_file() else {})


def read_tensors(folder: Path, dtype: torch.dtype, device: torch.device, transform=None,
                 vision: bool = False) -> dict[str, torch.Tensor]:
    """Every tensor of a folder's safetensors under its canonical name, converted one at a time; the vision
    tower's (`visual.*`) only with `vision`, in `dtype` whatever the weight formats (the tower runs once per
    image, and its output must match the reference's)."""
    weights: dict[str, torch.Tensor] = {}
    for shard in shard_files(folder):
        with _opened(shard) as f:
            for name in f.keys():
                canon = canonical_name(name)
                visual = canon.startswith(VISION_PREFIX)
                if visual and not vision:
                    continue
                t = f.get_tensor(name)
                if visual:
                    weights[canon] = t.to(device=device, dtype=dtype)
                    continue
                # Decay parameters stay fp32: exp(A_log) in bf16 would lose the decay rates' precision.
                keep = torch.promote_types(dtype, torch.float32) if canon.endswith(("A_log", "dt_bias")) else dtype
                t = t.to(device=device, dtype=keep)
                weights[canon] = transform(canon, t) if transform else t
    return weights
