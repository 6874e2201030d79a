"""Vision projector GGUF files (`mmproj-*.gguf`, what llama.cpp's converter writes with --mmproj for Qwen3.5/3.6):
the vision tower of a GGUF `qwen35` model, beside the model file or named by the `mmproj` setting (`ninfer
convert` carries it: the tower in the shards, its metadata as a GGUF file without tensors).

The converter's conventions (its `conversion/qwen3vl.py`, read by llama.cpp's `tools/mtmd/clip.cpp`), undone so
the tower is transformers' own (`models/vision.py`):
- architecture `clip`, projector type `qwen3vl_merger`; the tower's shape under `clip.vision.*`, its width as
  `projection_dim` (the text model's hidden size), the processor's normalisation as `image_mean`/`image_std`;
- the patch embedding's 3D convolution is split over its two temporal frames: `v.patch_embd.weight` holds frame 0,
  `v.patch_embd.weight.1` frame 1;
- `v.blk.N.{ln1, attn_qkv, attn_out, ln2, ffn_up, ffn_down}` are block N's norm1, qkv, proj, norm2 and MLP;
  `v.post_ln` is the merger's norm, `mm.0` and `mm.2` its two linear layers;
- `clip.vision.attention.layer_norm_epsilon` is the text model's rms_norm_eps (1e-6, the tower's own, in every
  Qwen3.5/3.6 checkpoint);
- Qwen3-VL's projectors have the same type and add deepstack layers (`v.deepstack.*`), which Qwen3.5/3.6 lack.
"""
from __future__ import annotations

import re
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

from ..errors import ModelFormatError
from ..models.spec import ModelSpec, vision_parameters, vision_patch_elements
from . import VISION_PREFIX, VisionConfig
from .gguf_dequant import dequantize
from .gguf_file import GGUFHeader, qtype_name, read_header, tensor_bytes
from .gguf_meta import MetaReader

if TYPE_CHECKING:
    import torch

PROJECTOR = "qwen3vl_merger"
FIX = "give the mmproj-*.gguf file made from the same Qwen3.5/3.6 checkpoint as the model (--mmproj FILE or " \
      "`mmproj` in the profile), or remove it from beside the model file to run text only"
_PATCH, _PATCH_1 = "v.patch_embd.weight", "v.patch_embd.weight.1"  # the convolution's two temporal frames
_NAMES = {"v.patch_embd.bias": "patch_embed.proj.bias", "v.position_embd.weight": "pos_embed.weight",
          "v.post_ln.weight": "merger.norm.weight", "v.post_ln.bias": "merger.norm.bias",
          "mm.0.weight": "merger.linear_fc1.weight", "mm.0.bias": "merger.linear_fc1.bias",
          "mm.2.weight": "merger.linear_fc2.weight", "mm.2.bias": "merger.linear_fc2.bias"}
_BLOCK_NAMES = {"ln1": "norm1", "ln2": "norm2", "attn_qkv": "attn.qkv", "attn_out": "attn.proj",
                "ffn_up": "mlp.linear_fc1", "ffn_down": "mlp.linear_fc2"}
_BLOCK_RE = re.compile(r"^v\.blk\.(\d+)\.(\w+)\.(weight|bias)$")
# the vision markers of the prompt, found in the text model's vocabulary (the mmproj file has none)
_TOKENS = {"image": "<|image_pad|>", "video": "<|video_pad|>", "start": "<|vision_start|>", "end": "<|vision_end|>"}


def find_mmproj(model: Path, setting: str, text_meta: dict) -> Path | None:
    """The vision projector of a GGUF model: the file `setting` names, else the one `mmproj*.gguf` beside a qwen35
    model file; None: the model runs text only."""
    qwen35 = text_meta.get("general.architecture") == "qwen35"
    if setting:
        path = Path(setting).expanduser()
        if not path.is_file():
            raise ModelFormatError(f"mmproj file {str(path)!r} does not exist", hint=FIX)
        if not qwen35:
            raise ModelFormatError(f"a vision projector (mmproj {path.name}) loads with Qwen3.5/3.6 GGUF models "
                                   f"only; {model.name} is a {text_meta.get('general.architecture')} model",
                                   hint="leave mmproj empty for this model")
        return path
    if not qwen35:
        return None
    found = sorted(p for p in model.parent.iterdir()
                   if p.name.lower().startswith("mmproj") and p.name.lower().endswith(".gguf") and p.is_file()
                   and p != model)
    if len(found) > 1:
        raise ModelFormatError(f"{len(found)} vision projector files beside {model.name} "
                               f"({', '.join(p.name for p in found)}): which one to load is not clear",
                               hint="choose one with --mmproj FILE (or `mmproj` in the profile)")
    return found[0] if found else None


def _canonical(name: str) -> str | None:
    """The tower's tensor name (models/vision.py's, without `visual.`) of a projector tensor; the patch embedding's
    two frames both map to its weight."""
    if name in (_PATCH, _PATCH_1):
        return "patch_embed.proj.weight"
    if name in _NAMES:
        return _NAMES[name]
    m = _BLOCK_RE.match(name)
    if m and m.group(2) in _BLOCK_NAMES:
        return f"blocks.{m.group(1)}.{_BLOCK_NAMES[m.group(2)]}.{m.group(3)}"
    return None


def _shapes(cfg: dict) -> dict[str, tuple[int, ...]]:
    """The stored shape (torch order) of every tensor of a projector with this vision_config."""
    h, i, m2 = cfg["hidden_size"], cfg["intermediate_size"], cfg["spatial_merge_size"] ** 2
    frame = (h, cfg["in_channels"], cfg["patch_size"], cfg["patch_size"])
    out = {_PATCH: frame, _PATCH_1: frame, "v.patch_embd.bias": (h,),
           "v.position_embd.weight": (cfg["num_position_embeddings"], h), "v.post_ln.weight": (h,),
           "v.post_ln.bias": (h,), "mm.0.weight": (h * m2, h * m2), "mm.0.bias": (h * m2,),
           "mm.2.weight": (cfg["out_hidden_size"], h * m2), "mm.2.bias": (cfg["out_hidden_size"],)}
    for b in range(cfg["depth"]):
        for name, (rows, cols) in {"ln1": (h, 0), "ln2": (h, 0), "attn_qkv": (3 * h, h), "attn_out": (h, h),
                                   "ffn_up": (i, h), "ffn_down": (h, i)}.items():
            out[f"v.blk.{b}.{name}.weight"] = (rows, cols) if cols else (rows,)
            out[f"v.blk.{b}.{name}.bias"] = (rows,)
    return out


def _check(path: Path, header: GGUFHeader) -> None:
    """The file is a Qwen3.5/3.6 vision projector, or the error says what it is."""
    from .gguf import SUPPORTED_TYPES

    meta, name = header.metadata, path.name
    arch = meta.get("general.architecture")
    if arch != "clip":
        raise ModelFormatError(f"{name} is not a vision projector (a GGUF {arch} model, not an mmproj file)",
                               hint=FIX)
    kind = meta.get("clip.vision.projector_type", meta.get("clip.projector_type"))
    if kind != PROJECTOR or not meta.get("clip.has_vision_encoder", False):
        raise ModelFormatError(f"{name} is a {kind!r} projector, not a Qwen3.5/3.6 vision projector ({PROJECTOR})",
                               hint=FIX)
    if any(meta.get("clip.vision.is_deepstack_layers", ())) or any(t.name.startswith("v.deepstack.")
                                                                    for t in header.tensors):
        raise ModelFormatError(f"{name} is a Qwen3-VL vision projector (deepstack layers), not a Qwen3.5/3.6 one",
                               hint=FIX)
    for t in header.tensors:
        if _canonical(t.name) is None:
            raise ModelFormatError(f"unexpected tensor {t.name!r} in the vision projector {name}", hint=FIX)
        if t.qtype not in SUPPORTED_TYPES:
            raise ModelFormatError(f"tensor {t.name!r} of {name} uses quant type {qtype_name(t.qtype)}, which "
                                   "ninfer does not support", hint="use an F16, BF16, F32 or Q8_0 mmproj file")


def projector_config(path: Path, text: ModelSpec, text_meta: dict) -> tuple[VisionConfig, dict]:
    """A projector file's VisionConfig for this text model (from its header: the weights are not read), and the
    tower's shape as a checkpoint's vision_config would give it."""
    header = read_header(path)
    _check(path, header)
    by_name = {t.name: t for t in header.tensors}
    missing = [n for n in (_PATCH, _PATCH_1, "v.position_embd.weight") if n not in by_name]
    if missing:  # the shapes the metadata does not give
        raise ModelFormatError(f"the vision projector {path.name} lacks tensor {missing[0]!r}", hint=FIX)
    cfg = _tower_shape(path.name, header.metadata, int(by_name[_PATCH].shape[1]),
                       int(by_name["v.position_embd.weight"].shape[0]), text)
    for n, shape in _shapes(cfg).items():
        if n not in by_name:
            raise ModelFormatError(f"the vision projector {path.name} lacks tensor {n!r}", hint=FIX)
        if by_name[n].shape != shape:
            raise ModelFormatError(f"tensor {n!r} of {path.name} has shape {by_name[n].shape}, its metadata "
                                   f"implies {shape}", hint=FIX)
    return _vision_config(path.name, header.metadata, cfg, text_meta), cfg


def kept_projector_config(name: str, meta: dict, in_channels: int, positions: int, text: ModelSpec,
                          text_meta: dict) -> tuple[VisionConfig, dict]:
    """`projector_config` of a projector's metadata kept without its tensors (a converted folder's, its tower in
    the shards), given the two sizes only the tensors tell: the patch embedding's input channels and the learned
    positions."""
    cfg = _tower_shape(name, meta, in_channels, positions, text)
    return _vision_config(name, meta, cfg, text_meta), cfg


def _tower_shape(name: str, meta: dict, in_channels: int, positions: int, text: ModelSpec) -> dict:
    """The tower's shape as a checkpoint's vision_config gives it, from a projector's metadata; its embeddings
    must have the text model's width."""
    get = MetaReader(meta, "clip.vision")
    cfg = {"depth": int(get("block_count")), "hidden_size": int(get("embedding_length")),
           "intermediate_size": int(get("feed_forward_length")), "num_heads": int(get("attention.head_count")),
           "out_hidden_size": int(get("projection_dim")), "patch_size": int(get("patch_size")),
           "temporal_patch_size": 2, "spatial_merge_size": int(get("spatial_merge_size", 2)),
           "in_channels": in_channels, "num_position_embeddings": positions,
           "hidden_act": "silu" if meta.get("clip.use_silu") else "gelu_pytorch_tanh"}
    if cfg["out_hidden_size"] != text.hidden_size:
        raise ModelFormatError(f"the vision projector {name} makes embeddings of width {cfg['out_hidden_size']}, "
                               f"the model's hidden size is {text.hidden_size}", hint=FIX)
    return cfg


def _vision_config(name: str, meta: dict, cfg: dict, text_meta: dict) -> VisionConfig:
    """The VisionConfig of a projector's metadata and tower shape, its image tokens from the text model's
    vocabulary."""
    from ..models.vision import vision_spec

    get = MetaReader(meta, "clip.vision")
    spec = replace(vision_spec(cfg), eps=float(get("attention.layer_norm_epsilon", 1e-6)))
    tokens = {t: i for i, t in enumerate(text_meta.get("tokenizer.ggml.tokens", ())) if t in _TOKENS.values()}
    ids = {}
    for role, text_token in _TOKENS.items():
        if text_token not in tokens:
            raise ModelFormatError(f"the model's vocabulary lacks {text_token}, which prompts with images need",
                                   hint="use the text model GGUF of the checkpoint the projector was made from")
        ids[role] = tokens[text_token]
    mean, std = get("image_mean", (0.5,) * 3), get("image_std", (0.5,) * 3)
    if len(mean) != 3 or len(std) != 3:
        raise ModelFormatError(f"the vision projector {name} has an image mean or std without 3 channels",
                               hint=FIX)
    return VisionConfig(spec, ids["image"], ids["video"], ids["start"], ids["end"],
                        tuple(float(x) for x in mean), tuple(float(x) for x in std),
                        int(get("image_min_pixels", VisionConfig.min_pixels)))


def with_tower(spec: ModelSpec, cfg: dict) -> ModelSpec:
    """The text model's geometry with the tower's counts (the memory plan's)."""
    return replace(spec, vision_params=vision_parameters(cfg), vision_patch_elements=vision_patch_elements(cfg),
                   vision_patch_size=cfg["patch_size"])


def load_tower(path: Path, dtype: torch.dtype, device: torch.device) -> dict[str, torch.Tensor]:
    """The tower's tensors (a file `projector_config` accepted) dequantized to `dtype`, under `visual.*` names."""
    import torch

    header = read_header(path)
    stored = tensor_bytes(path, header)
    out = {}
    for t in header.tensors:  # one tensor in fp32 at a time
        out[t.name] = torch.from_numpy(dequantize(stored[t.name], t.qtype, t.shape)).to(device=device, dtype=dtype)
    # the convolution's kernel over its temporal axis again: [out, channels, frames, rows, columns]
    out[_PATCH] = torch.stack([out[_PATCH], out.pop(_PATCH_1)], dim=2)
    return {VISION_PREFIX + _canonical(name): w for name, w in out.items()}
