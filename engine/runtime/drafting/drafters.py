"""Build the drafter an EngineConfig asks for."""
from __future__ import annotations

from pathlib import Path

import torch

from ...config import EngineConfig
from ...errors import UserError
from ...parallel.shards import first_rows  # GGUF heads (blocks) too
from ...quant.qweight import GROUP, quantize
from .ngram import NgramDrafter


def make_drafter(config: EngineConfig, model):
    """None for spec = "none"; otherwise a drafter checked against the target (shapes named when they differ),
    wrapped in a ControlledDrafter when `draft_acceptance` is set (benchmarks: the drafter still runs, its guesses
    are replaced). With spec = "none" `draft_acceptance` does nothing, so a benchmark's no-draft baseline is the
    same settings with spec = "none"."""
    if config.spec == "none":
        return None
    drafter = _make(config, model)
    if config.draft_acceptance > 0:
        from .controlled import ControlledDrafter

        drafter = ControlledDrafter(drafter, config.draft_acceptance, model.geometry.vocab_size, seed=config.seed)
    return drafter


def _make(config: EngineConfig, model):
    """The drafter `config.spec` names. MTP and DFlash score their guesses with an LM head (`head`), cut to the
    first `draft_vocab` token ids when that is set: a view of those rows, so each guess reads only them."""
    if config.spec == "ngram":
        return NgramDrafter()
    if config.draft_vocab >= model.geometry.vocab_size:
        raise UserError(f"draft_vocab ({config.draft_vocab}) must be below the model's vocabulary "
                        f"({model.geometry.vocab_size})", hint="lower it, or set 0 to draft over every token")
    if config.spec == "mtp":
        from ...models.mtp import MTPDrafter

        if not model.geometry.is_hybrid:
            raise UserError(f"spec = \"mtp\" needs a Qwen3.5/3.6 model with MTP weights; {model.geometry.arch!r} "
                            "has no MTP head", hint='use spec = "ngram"')
        drafter = MTPDrafter(model, graphs=config.cuda_graphs)
    else:
        drafter = load_dflash(config, model)
    if config.draft_vocab:
        drafter.head = first_rows(drafter.head, config.draft_vocab)
    return drafter


def load_dflash(config: EngineConfig, model):
    from ...loaders.safetensors import read_tensors
    from ...loaders.synthetic import random_weights
    from ...models.dflash import DFlashDrafter, check_fits, dflash_shapes, dflash_spec, drafter_config

    d = dflash_spec(drafter_config(config.drafter))
    check_fits(d, model.geometry)  # before any weight is read
    if config.draft_tokens >= d.block_size:  # it learned to fill block_size - 1 positions after the pending token
        raise UserError(f"draft_tokens = {config.draft_tokens} is more than this DFlash drafter guesses at once "
                        f"({d.block_size - 1}: its blocks are {d.block_size} tokens)",
                        hint=f"set draft_tokens to {d.block_size - 1} or less")
    transform = drafter_transform(config)
    if config.drafter.startswith("synthetic:"):
        weights = random_weights(dflash_shapes(d), model.dtype, model.device, seed=1, transform=transform)
    else:
        weights = read_tensors(Path(config.drafter).expanduser(), model.dtype, model.device, transform)
    return DFlashDrafter(d, weights, model, own_head=not config.lm_head_draft, graphs=config.cuda_graphs)


def drafter_transform(config: EngineConfig):
    """Quantize the drafter's projections to `config.drafter_weights` as they load (None: keep them)."""
    fmt = config.drafter_weights
    if fmt == "auto":
        return None

    def transform(name: str, w: torch.Tensor):
        if w.dim() == 2 and w.shape[1] % GROUP == 0:
            return quantize(w, fmt)
        return w

    return transform
