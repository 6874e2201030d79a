"""An image file's bytes -> the vision tower's input, as transformers' Qwen image processor makes it (its Pillow
backend): EXIF orientation applied, transparency composited onto white, resized (bicubic) to a size on the
patch grid within the pixel bounds, scaled to [0, 1], normalised, and cut into patches in merge-block order, each
patch's pixels channels-first and repeated over the temporal patch (an image is one frame).

Every way an image can be refused is a UserError naming the part (`where`) and the limit: not decodable, a type
Pillow reads but the API does not take, too many bytes or pixels to decode, an extreme aspect ratio. Pixels and
aspect are checked from the file's header, before anything is decoded: a small file can name a huge canvas. An
image of twice the resize's target or more on each side is shrunk by an integer factor before its colours are
converted and composited and before the resize (a JPEG as it is decoded, by its DCT scaling; the others by
`Image.reduce` after one whole decode).
"""
from __future__ import annotations

import hashlib
import io
import math
import threading
from dataclasses import dataclass

import numpy as np
import torch

from ..errors import UserError
from ..models.vision import VisionSpec

FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "BMP")  # what the OpenAI and Anthropic APIs take, and BMP
MAX_ASPECT = 200  # the processor's own bound: a strip thinner than this has no grid
# The decoder's bound, from the resize bound: a canvas this many times the pixels an image keeps still holds a 5K
# screenshot at the default 1 MP, and at most MAX_DECODE_PIXELS whatever the settings (~160 MB as RGBA)
DECODE_FACTOR = 16
MAX_DECODE_PIXELS = 40_000_000
# Decoding takes a core and up to a few copies of the canvas: a burst of image (and video) requests waits here
# instead of taking every core and that memory many times over
DECODING = threading.BoundedSemaphore(2)


@dataclass(frozen=True)
class ImageBounds:
    """What one image may cost: `max_bytes` of file, `max_pixels` after resizing (larger ones shrink to it),
    `min_pixels` after resizing (smaller ones grow to it); `decode_pixels` guards the decoder itself."""

    max_bytes: int
    max_pixels: int
    min_pixels: int = 65536

    @property
    def decode_pixels(self) -> int:
        return min(DECODE_FACTOR * self.max_pixels, MAX_DECODE_PIXELS)

    @property
    def variant(self) -> bytes:
        """The bounds that shape what a file makes, for its digest (`PreparedImages.get`)."""
        return f"image {self.max_pixels} {self.min_pixels}".encode()


@dataclass(frozen=True)
class Norm:
    """The processor's normalisation (the checkpoint's preprocessor_config.json)."""

    mean: tuple[float, float, float] = (0.5, 0.5, 0.5)
    std: tuple[float, float, float] = (0.5, 0.5, 0.5)


@dataclass(frozen=True)
class Image:
    """An image ready for the tower: its patches, its (t, h, w) patch grid, the pad tokens it takes in the prompt
    and a digest of what made them, its file and bounds (the key of its embeddings, and of its place in held
    conversations)."""

    pixels: torch.Tensor  # [t * h * w, patch_dim] fp32
    grid: tuple[int, int, int]
    tokens: int
    digest: bytes


def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """The processor's target size: both sides multiples of `factor`, the area within the bounds, the aspect
    ratio kept as well as that allows."""
    h, w = round(height / factor) * factor, round(width / factor) * factor
    if h * w > max_pixels:
        beta = math.sqrt(height * width / max_pixels)
        h = max(factor, math.floor(height / beta / factor) * factor)
        w = max(factor, math.floor(width / beta / factor) * factor)
    elif h * w < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h, w = math.ceil(height * beta / factor) * factor, math.ceil(width * beta / factor) * factor
    return h, w


def preprocess(data: bytes, spec: VisionSpec, bounds: ImageBounds, norm: Norm, where: str, digest: bytes) -> Image:
    """An image file's bytes as the tower's input under `digest` (`PreparedImages` gives its file's); UserError
    naming `where` (the request part) when it is refused."""
    if len(data) > bounds.max_bytes:
        raise UserError(f"{where}: the image is {len(data) / 2**20:.1f} MiB, more than the "
                        f"{bounds.max_bytes / 2**20:.0f} MiB an image may be",
                        hint="send a smaller or more compressed image")
    with DECODING:
        img = _opened(data, bounds, where)
        try:  # reading the EXIF tag may decode (a PNG keeps it anywhere)
            turned = img.getexif().get(0x0112) in (5, 6, 7, 8)  # EXIF orientations that turn it by 90 degrees
            size = _target(*((img.height, img.width) if turned else img.size), spec, bounds)
            img = _decoded(img, size, turned)
        except Exception as exc:  # Pillow raises many types for bad files; each is the client's bad image
            raise UserError(f"{where}: the image cannot be decoded ({type(exc).__name__})",
                            hint="send a valid PNG, JPEG, WebP, GIF or BMP file") from None
        return _tower_input(_rgb(img), size, spec, norm, digest)


def _opened(data: bytes, bounds: ImageBounds, where: str):
    """The image with only its header read, refused when its type, canvas or aspect ratio is not taken."""
    from PIL import Image as PILImage

    try:
        img = PILImage.open(io.BytesIO(data))
    except PILImage.DecompressionBombError:  # Pillow's own bound, far above ours: refused the same way
        img = None
    except Exception as exc:  # Pillow raises many types for bad files; each is the client's bad image
        raise UserError(f"{where}: the image cannot be decoded ({type(exc).__name__})",
                        hint="send a valid PNG, JPEG, WebP, GIF or BMP file") from None
    if img is None or img.width * img.height > bounds.decode_pixels:
        raise UserError(f"{where}: the image has more than {bounds.decode_pixels} pixels",
                        hint="send a smaller image")
    if img.format not in FORMATS:
        raise UserError(f"{where}: image type {img.format} is not supported", hint="send PNG, JPEG, WebP, GIF or BMP")
    width, height = img.size
    if max(width, height) > MAX_ASPECT * min(width, height):
        raise UserError(f"{where}: the image is {width}x{height}, an aspect ratio over {MAX_ASPECT}",
                        hint="crop it closer to a rectangle")
    return img


def _decoded(img, size: tuple[int, int], turned: bool):
    """The image decoded, upright (EXIF orientation), and shrunk by an integer factor while it stays at least
    `size` (the resize's target) on each side: JPEG's DCT scaling decodes it so, `reduce` averages blocks. An
    image less than twice the target on a side is left whole, so the resize alone makes it, as the processor's
    does."""
    from PIL import ImageOps

    width, height = size
    if img.format == "JPEG" and min(img.width // width, img.height // height) >= 2:
        img.draft(img.mode, (height, width) if turned else (width, height))
    img = ImageOps.exif_transpose(img)
    img.load()
    factor = min(img.width // width, img.height // height)
    if factor < 2:
        return img
    # the modes `reduce` takes (averaging LA and RGBA premultiplied); a palette or a transparent colour goes first
    if img.mode not in ("L", "LA", "RGB", "RGBA") or img.info.get("transparency") is not None:
        img = img.convert("RGBA" if _transparent(img) else "RGB")
    return img.reduce(factor)


def _target(width: int, height: int, spec: VisionSpec, bounds: ImageBounds) -> tuple[int, int]:
    """(width, height) the image is resized to."""
    h, w = smart_resize(height, width, spec.patch_size * spec.spatial_merge_size, bounds.min_pixels,
                        bounds.max_pixels)
    return w, h


def image_input(img, spec: VisionSpec, bounds: ImageBounds, norm: Norm) -> Image:
    """An RGB Pillow image as the tower's input, its digest of its pixels and bounds (it has no file)."""
    digest = hashlib.sha256(bounds.variant + repr(img.size).encode() + img.tobytes()).digest()
    return _tower_input(img, _target(img.width, img.height, spec, bounds), spec, norm, digest)


def _tower_input(img, size: tuple[int, int], spec: VisionSpec, norm: Norm, digest: bytes) -> Image:
    """An RGB Pillow image resized to `size` (width, height), normalised and cut into patches."""
    from PIL import Image as PILImage

    p, m, tp = spec.patch_size, spec.spatial_merge_size, spec.temporal_patch_size
    width, height = size
    resized = np.asarray(img.resize(size, PILImage.Resampling.BICUBIC))
    pixels = (resized.astype(np.float64) * (1 / 255)).astype(np.float32)  # the processor's rounding steps
    mean, std = np.asarray(norm.mean, dtype=np.float32), np.asarray(norm.std, dtype=np.float32)
    pixels = ((pixels - mean) / std).transpose(2, 0, 1)  # [3, H, W]
    gh, gw = height // p, width // p
    patches = pixels.reshape(3, gh // m, m, p, gw // m, m, p).transpose(1, 4, 2, 5, 0, 3, 6)
    patches = np.broadcast_to(patches[:, :, :, :, :, None], (*patches.shape[:5], tp, p, p))
    flat = torch.from_numpy(np.ascontiguousarray(patches).reshape(gh * gw, 3 * tp * p * p))
    return Image(flat, (1, gh, gw), gh * gw // m ** 2, digest)


def _rgb(img):
    """RGB, with any transparency composited onto white (the processor's conversion)."""
    from PIL import Image as PILImage

    if _transparent(img):
        rgba = img.convert("RGBA")
        return PILImage.alpha_composite(PILImage.new("RGBA", img.size, (255, 255, 255, 255)), rgba).convert("RGB")
    return img.convert("RGB")


def _transparent(img) -> bool:
    return "A" in img.getbands() or img.info.get("transparency") is not None
