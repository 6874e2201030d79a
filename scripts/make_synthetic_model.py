"""Write a random-weight Qwen3.5-family HF folder through transformers, so our loader and the oracle read the
same files: config.json, model.safetensors, tokenizer.json (+ chat template).

Usage: python scripts/make_synthetic_model.py --preset tiny [--seed 0] [--override '{"num_hidden_layers": 6}'] --out DIR
(The qwen3.6-27b preset writes ~54 GB; GPU benchmarks use `--model synthetic:qwen3.6-27b` instead.)
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from engine.loaders.synthetic import random_weights
from engine.models.presets import PRESETS
from engine.models.qwen3_5 import Qwen35Model
from engine.models.spec import spec_from_hf_config
from engine.tokenizer.byte_level import SPECIALS, byte_level_backend
from engine.tokenizer.hf_folder import BUILTIN_TEMPLATES


def write_synthetic(out: Path, config: dict, seed: int = 0, vision: dict | None = None) -> Path:
    """`vision`: a vision_config, for a vision-language folder (transformers' Qwen3_5ForConditionalGeneration;
    the image tokens are the byte-level tokenizer's)."""
    from transformers import Qwen3_5Config, Qwen3_5ForCausalLM, Qwen3_5ForConditionalGeneration, Qwen3_5TextConfig

    out.mkdir(parents=True, exist_ok=True)
    fields = {k: v for k, v in config.items() if k != "model_type"}
    hf_config = Qwen3_5TextConfig(**fields)
    text_prefix = "model."
    if vision is not None:
        ids = {name: SPECIALS.index(f"<|{name}|>") + 256 for name in ("vision_start", "vision_end", "image_pad",
                                                                    "video_pad")}
        hf_config = Qwen3_5Config(text_config=fields, vision_config=vision, image_token_id=ids["image_pad"],
                                  video_token_id=ids["video_pad"], vision_start_token_id=ids["vision_start"],
                                  vision_end_token_id=ids["vision_end"],
                                  tie_word_embeddings=fields.get("tie_word_embeddings", False))
        text_prefix = "model.language_model."
    with torch.device("meta"):
        model = (Qwen3_5ForCausalLM if vision is None else Qwen3_5ForConditionalGeneration)(hf_config)
    ours = random_weights(Qwen35Model.weight_shapes(spec_from_hf_config(config)), torch.float32,
                          torch.device("cpu"), seed)
    state = {("lm_head.weight" if k == "lm_head.weight" else text_prefix + k): v for k, v in ours.items()}
    g = torch.Generator().manual_seed(seed + 1)
    for name, p in model.state_dict().items():  # the tower: random everywhere, no zero bias or unit norm
        if name.startswith("model.visual."):
            state[name] = torch.randn(p.shape, generator=g) * 0.1
    tied = config.get("tie_word_embeddings", False)
    model.load_state_dict(state, strict=not tied, assign=True)
    if tied:
        model.tie_weights()
    model.save_pretrained(out)
    if config["vocab_size"] < 248077:  # tiny vocabularies: bytes + specials
        byte_level_backend().save(str(out / "tokenizer.json"))
        (out / "tokenizer_config.json").write_text(json.dumps(
            {"eos_token": "<|im_end|>", "added_special_tokens": list(SPECIALS), "add_bos_token": False}))
    (out / "chat_template.jinja").write_text((BUILTIN_TEMPLATES / "qwen3_5.jinja").read_text())
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", choices=sorted(PRESETS), default="tiny")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--override", default="{}", help="JSON object of config fields to change")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    config = {**PRESETS[args.preset], **json.loads(args.override)}
    vision = config.pop("vision_config", None)  # a -vl preset's tower: a vision-language folder
    print(write_synthetic(Path(args.out), config, args.seed, vision))


if __name__ == "__main__":
    main()
