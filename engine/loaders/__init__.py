"""Loaders: turn a model reference into named tensors, a ModelSpec, a tokenizer and a chat template."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from ..errors import ModelFormatError
from ..models.spec import ModelSpec
from ..tokenizer import Tokenizer

if TYPE_CHECKING:  # torch only in annotations: reading a header (`ninfer show`) stays light
    import torch

    from ..models.vision import VisionSpec

VISION_PREFIX = "visual."  # the vision tower's tensors among a LoadedModel's weights


@dataclass(frozen=True)
class VideoSampling:
    """The checkpoint's video processor (its video_preprocessor_config.json, Qwen3.5's values without): frames
    taken per second of video, the fewest and most frames taken, and the pixels of all the frames together."""

    fps: float = 2.0
    min_frames: int = 4
    max_frames: int = 768
    min_pixels: int = 4096
    max_pixels: int = 25165824


@dataclass(frozen=True)
class VisionConfig:
    """A vision-language checkpoint's vision side: the tower's shape, the prompt's image and video token ids, the
    processor's normalisation and smallest image (its preprocessor_config.json, Qwen3.5's values without), and
    how videos are sampled."""

    spec: VisionSpec
    image_token_id: int
    video_token_id: int
    vision_start_id: int
    vision_end_id: int
    mean: tuple[float, float, float] = (0.5, 0.5, 0.5)
    std: tuple[float, float, float] = (0.5, 0.5, 0.5)
    min_pixels: int = 65536
    video: VideoSampling = VideoSampling()


def vision_config(config: dict, processor: dict, video: dict | None = None) -> VisionConfig:
    """The VisionConfig of a checkpoint's config.json (with a vision_config), preprocessor_config.json and
    video_preprocessor_config.json."""
    from ..models.vision import vision_spec

    size = processor.get("size") or {}
    video = video or {}
    default = VideoSampling()
    together = video.get("size") or {}  # the pixels of all of a video's frames
    try:
        sampling = VideoSampling(float(video.get("fps", default.fps)),
                                 int(video.get("min_frames", default.min_frames)),
                                 int(video.get("max_frames", default.max_frames)),
                                 int(together.get("shortest_edge", default.min_pixels)),
                                 int(together.get("longest_edge", default.max_pixels)))
        return VisionConfig(vision_spec(config["vision_config"]), int(config["image_token_id"]),
                            int(config["video_token_id"]), int(config["vision_start_token_id"]),
                            int(config["vision_end_token_id"]), tuple(processor.get("image_mean", (0.5,) * 3)),
                            tuple(processor.get("image_std", (0.5,) * 3)),
                            int(size.get("shortest_edge", processor.get("min_pixels", 65536))), sampling)
    except KeyError as exc:
        raise ModelFormatError(f"config.json has a vision_config but lacks {exc.args[0]!r}") from None
    except (TypeError, ValueError):
        raise ModelFormatError("video_preprocessor_config.json has a value of the wrong type") from None


@dataclass
class LoadedModel:
    geometry: ModelSpec
    weights: dict[str, torch.Tensor]  # canonical (HF-style, no "model." prefix) names; the tower's as visual.*
    tokenizer: Tokenizer
    chat_template: str | None
    source: str
    vision: VisionConfig | None = None  # a vision-language checkpoint's, with its tower among the weights


def model_kind(ref: str) -> str:
    """"synthetic", "converted" (a folder `ninfer convert` wrote), "folder" or "gguf" for a model reference, or a
    clear error."""
    if ref.startswith("synthetic:"):
        return "synthetic"
    path = Path(ref).expanduser()
    if not path.exists():
        raise ModelFormatError(
            f"model path {str(path)!r} does not exist",
            hint="give a registry name (see `ninfer models`), a .gguf file, or a HF model folder",
        )
    if path.is_dir():
        from .manifest import MANIFEST

        return "converted" if (path / MANIFEST).is_file() else "folder"
    with path.open("rb") as f:
        magic = f.read(4)
    if magic == b"GGUF":
        return "gguf"
    raise ModelFormatError(
        f"{str(path)!r} is neither a GGUF file nor a HF model folder",
        hint="give a .gguf file, or a folder with config.json and *.safetensors",
    )


def read_json(path: Path) -> dict:
    """A JSON object file of a model folder (config.json, tokenizer_config.json), or what is wrong with it."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ModelFormatError(f"{path} is not readable JSON: {exc}") from None
    if not isinstance(data, dict):
        raise ModelFormatError(f"{path} is not a JSON object")
    return data


def hf_config(folder: Path) -> dict:
    """A HF model folder's config.json (torch-free: `ninfer show` reads it too)."""
    path = folder / "config.json"
    if not path.is_file():
        raise ModelFormatError(f"{folder} has no config.json", hint="give a HF model folder or a .gguf file")
    return read_json(path)


def check_mmproj(ref: str, kind: str, mmproj: str) -> None:
    """A vision projector file is set for a GGUF model only (`kind`: `model_kind(ref)`)."""
    if mmproj and kind != "gguf":
        raise ModelFormatError(f"mmproj {mmproj!r} is set for {ref}, which is not a GGUF file",
                               hint="leave mmproj empty: a vision projector file is for a GGUF model (a model "
                               "folder holds its vision tower itself)")


def read_spec(ref: str, vision: bool = True, mmproj: str = "") -> ModelSpec:
    """The geometry of a model without loading its weights (for the memory plan); with `vision`, a GGUF model's
    vision projector (`mmproj`, or the one beside it) counted."""
    kind = model_kind(ref)
    check_mmproj(ref, kind, mmproj)
    if kind == "synthetic":
        from .synthetic import preset_spec

        return preset_spec(ref.split(":", 1)[1])
    if kind == "converted":
        from .converted import converted_spec

        return converted_spec(Path(ref).expanduser())
    if kind == "folder":
        from .safetensors import folder_spec

        return folder_spec(Path(ref).expanduser())
    from .gguf import gguf_spec

    return gguf_spec(Path(ref).expanduser(), vision, mmproj)


def load_model(ref: str, dtype: torch.dtype, device: torch.device, transform=None,
               vision: bool = True, tiled: bool = False, verified_shards: str = "", mmproj: str = "") -> LoadedModel:
    """Load a `.gguf` file, a HF folder, a converted folder or `synthetic:PRESET`. `transform(name, tensor)` (from
    quant/) is applied to each weight as it arrives, except in a converted folder, whose weights are stored in
    their formats already (`tiled`: its q4/q5 weights take the tiled layout where the CUDA kernels run, as
    `transform` makes them; `verified_shards`: the record of its shards hashed before, empty = hash them all); a
    vision tower is loaded only with `vision` (a GGUF model's from its projector file: `mmproj`, or the one
    `mmproj*.gguf` beside it)."""
    kind = model_kind(ref)
    check_mmproj(ref, kind, mmproj)
    if kind == "synthetic":
        from .synthetic import load_synthetic

        return load_synthetic(ref.split(":", 1)[1], dtype, device, transform=transform, vision=vision)
    if kind == "converted":
        from .converted import load_converted

        return load_converted(Path(ref).expanduser(), dtype, device, tiled, vision,
                              verified_shards=Path(verified_shards) if verified_shards else None)
    if kind == "folder":
        from .safetensors import load_hf_folder

        return load_hf_folder(Path(ref).expanduser(), dtype, device, transform, vision)
    from .gguf import load_gguf

    return load_gguf(Path(ref).expanduser(), dtype, device, transform, vision=vision, mmproj=mmproj)
