"""Build the drafter an EngineConfig asks for."""
from __future__ import annotations

from pathlib import Path

import torch

from ...config import EngineConfig
from ...errors import UserError
from .ngram import NgramDrafter


def make_drafter(config: EngineConfig, model):
    """None for spec = "none"; otherwise a drafter checked against the target (shapes named when they differ)."""
    if config.spec == "none":
        return None
    if config.spec == "ngram":
        return NgramDrafter()
    if config.spec == "mtp":
        from ...models.mtp import MTPDrafter

        if not model.spec.is_hybrid:
            raise UserError(f"spec = \"mtp\" needs a Qwen3.5/3.6 model with MTP weights; {model.spec.arch!r} "
                            "has no MTP head", hint='use spec = "ngram"')
        return MTPDrafter(model)
    return load_dflash(config, model)


def load_dflash(config: EngineConfig, model):
    from ...loaders.synthetic import random_weights
    from ...models.dflash import DFlashDrafter, check_fits, dflash_shapes, dflash_spec, read_dflash_config
    from ...models.presets import DRAFTER_PRESETS

    ref = config.drafter
    transform = drafter_transform(config)
    if ref.startswith("synthetic:"):
        preset = ref.split(":", 1)[1]
        if preset not in DRAFTER_PRESETS:
            raise UserError(f"unknown synthetic drafter {preset!r}", hint="presets: " + ", ".join(DRAFTER_PRESETS))
        d = dflash_spec(DRAFTER_PRESETS[preset])
        check_fits(d, model.spec)
        weights = random_weights(dflash_shapes(d), model.dtype, model.device, seed=1, transform=transform)
    else:
        from ...loaders.safetensors import read_tensors

        folder = Path(ref).expanduser()
        if not folder.is_dir():
            raise UserError(f"drafter path {str(folder)!r} is not a folder",
                            hint="set drafter to a DFlash checkpoint folder (config.json + *.safetensors)")
        d = dflash_spec(read_dflash_config(folder))
        check_fits(d, model.spec)
        weights = read_tensors(folder, model.dtype, model.device, transform)
    return DFlashDrafter(d, weights, model, own_head=not config.lm_head_draft)


def drafter_transform(config: EngineConfig):
    """Drafter projections keep 8 bits when the target's are quantized (sliding-window drafters are reported to
    break at 4 bits), the compute dtype otherwise."""
    from ...quant.qweight import GROUP, quantize

    if not config.weights.quantized():
        return None

    def transform(name: str, w: torch.Tensor):
        if w.dim() == 2 and w.shape[1] % GROUP == 0:
            return quantize(w, "q8")
        return w

    return transform
