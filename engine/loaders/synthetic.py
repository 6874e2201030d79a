"""`synthetic:PRESET`: random weights built directly on the target device (GPU benchmarks cannot write 54 GB);
a preset with a vision_config has a vision tower of random weights too."""
from __future__ import annotations

import math

import torch

from ..errors import UserError
from ..models.presets import PRESETS
from ..models.qwen3_5 import Qwen35Model, mtp_shapes
from ..models.spec import ModelSpec, spec_from_hf_config
from ..models.vision import VisionSpec, tower_shapes, vision_spec
from ..tokenizer.byte_level import byte_level_tokenizer
from ..tokenizer.hf_folder import BUILTIN_TEMPLATES
from ..tokenizer.qwen_tiktoken import QwenTiktokenTokenizer
from . import VISION_PREFIX, LoadedModel, VisionConfig


def random_weights(shapes: dict[str, tuple[int, ...]], dtype: torch.dtype, device: torch.device,
                   seed: int = 0, transform=None) -> dict[str, torch.Tensor]:
    """Random values for every weight: never zeros, scaled so activations stay O(1) through the layers."""
    g = torch.Generator(device=device).manual_seed(seed)
    out = {}
    for name, shape in shapes.items():
        if name.endswith("A_log"):
            t = torch.empty(shape, device=device, dtype=torch.float32).uniform_(0.0, 2.7, generator=g)
        elif name.endswith("dt_bias"):
            t = torch.randn(shape, device=device, dtype=torch.float32, generator=g) * 0.5
        elif len(shape) == 1:  # norms: zero-centred ones around 0, plain ones around 1
            base = 1.0 if name.endswith("linear_attn.norm.weight") else 0.0
            t = base + 0.1 * torch.randn(shape, device=device, dtype=torch.float32, generator=g)
        else:
            fan_in = shape[-1] if len(shape) == 2 else shape[-1] * shape[-2]
            t = torch.randn(shape, device=device, dtype=torch.float32, generator=g) * fan_in ** -0.5
        keep = torch.float32 if name.endswith(("A_log", "dt_bias")) else dtype
        out[name] = transform(name, t.to(keep)) if transform else t.to(keep)
    return out


def random_tower(spec: VisionSpec, dtype: torch.dtype, device: torch.device, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random values for the vision tower's tensors (`models/vision.py`'s names), scaled so that activations stay
    O(1) through the blocks: every matrix's rows of unit norm over its whole fan-in (the patch embedding's is
    channels x frames x rows x columns), the LayerNorms' weights around 1, small biases."""
    g = torch.Generator(device=device).manual_seed(seed)
    out = {}
    for name, shape in tower_shapes(spec).items():
        t = torch.randn(shape, device=device, dtype=torch.float32, generator=g)
        if len(shape) > 1:
            t *= math.prod(shape[1:]) ** -0.5
        else:
            t = (1.0 if name.split(".")[-2].startswith("norm") and name.endswith("weight") else 0.0) + 0.1 * t
        out[name] = t.to(dtype)
    return out


def preset_spec(preset: str) -> ModelSpec:
    if preset not in PRESETS:
        raise UserError(f"unknown synthetic preset {preset!r}", hint="presets: " + ", ".join(PRESETS))
    return spec_from_hf_config(PRESETS[preset])


def load_synthetic(preset: str, dtype: torch.dtype, device: torch.device, seed: int = 0,
                   transform=None, vision: bool = True) -> LoadedModel:
    """The preset's model; its vision tower (where it has a vision_config) only with `vision`, in `dtype` whatever
    `transform` makes of the text model's weights, as the other loaders keep it."""
    spec = preset_spec(preset)
    shapes = Qwen35Model.weight_shapes(spec)
    shapes.update(mtp_shapes(spec))  # after the target's, so adding MTP leaves the target's values unchanged
    weights = random_weights(shapes, dtype, device, seed, transform)
    # The real vocabulary where the model has room for it; tiny models get bytes + specials.
    tokenizer = QwenTiktokenTokenizer(spec.eos_token_ids) if spec.vocab_size >= 248077 else byte_level_tokenizer()
    template = (BUILTIN_TEMPLATES / "qwen3_5.jinja").read_text()
    config = PRESETS[preset].get("vision_config")
    tower = None
    if vision and config is not None:
        # a generator of its own: the text weights are those of the preset without the tower
        tower = VisionConfig(vision_spec(config), *(tokenizer.special[t] for t in (
            "<|image_pad|>", "<|video_pad|>", "<|vision_start|>", "<|vision_end|>")))
        weights.update({VISION_PREFIX + n: t for n, t in random_tower(tower.spec, dtype, device, seed + 1).items()})
    return LoadedModel(spec, weights, tokenizer, template, f"synthetic:{preset}", tower)
