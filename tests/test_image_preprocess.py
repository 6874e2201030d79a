"""Image files to the tower's input against transformers' Qwen image processor (its Pillow backend, Qwen3.5's
patch 16 / merge 2 / mean and std 0.5) on the same files, and the refusals, each naming the part and the limit."""
import io

import numpy as np
import pytest
import torch

from engine.errors import UserError
from engine.media.image import ImageBounds, Norm, preprocess
from engine.models.vision import vision_spec

from .conftest import rel_error

PIL = pytest.importorskip("PIL")
from PIL import Image as PILImage  # noqa: E402
from PIL import ImageOps  # noqa: E402

SPEC = vision_spec({"depth": 1, "hidden_size": 64, "intermediate_size": 96, "num_heads": 4, "out_hidden_size": 64})
BOUNDS = ImageBounds(max_bytes=4 << 20, max_pixels=256 * 256, min_pixels=64 * 64)


def picture(w: int, h: int, mode: str = "RGB", seed: int = 0) -> PILImage.Image:
    rgb = np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8)
    img = PILImage.fromarray(rgb)
    if mode == "RGBA":
        alpha = np.random.default_rng(seed + 1).integers(0, 256, (h, w), dtype=np.uint8)
        img.putalpha(PILImage.fromarray(alpha))
    elif mode == "P":
        img = img.quantize(16)
    return img


def encoded(img: PILImage.Image, fmt: str, **kw) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format=fmt, **kw)
    return buf.getvalue()


def exif_rotated(img: PILImage.Image) -> bytes:
    exif = PILImage.Exif()
    exif[0x0112] = 6  # orientation: rotate 90 degrees clockwise to display
    return encoded(img, "JPEG", exif=exif, quality=95)


FILES = {
    "png-odd": lambda: encoded(picture(101, 77), "PNG"),
    "rgba": lambda: encoded(picture(90, 60, "RGBA"), "PNG"),
    "palette-gif": lambda: encoded(picture(70, 50, "P"), "GIF"),
    "jpeg-exif": lambda: exif_rotated(picture(120, 64)),
    "large": lambda: encoded(picture(500, 380), "PNG"),  # shrinks, less than twice
    "tiny-webp": lambda: encoded(picture(20, 30), "WEBP", lossless=True),
}


@pytest.fixture(scope="module")
def processor():
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    return Qwen2VLImageProcessorPil(patch_size=16, merge_size=2, temporal_patch_size=2, image_mean=[0.5] * 3,
                                    image_std=[0.5] * 3, min_pixels=BOUNDS.min_pixels, max_pixels=BOUNDS.max_pixels)


@pytest.mark.parametrize("name", list(FILES))
def test_pixels_and_grid_equal_the_transformers_processor(processor, name):
    data = FILES[name]()
    got = preprocess(data, SPEC, BOUNDS, Norm(), "image", b"")
    want = processor(images=ImageOps.exif_transpose(PILImage.open(io.BytesIO(data))), return_tensors="pt")
    assert [list(got.grid)] == want["image_grid_thw"].tolist()
    assert got.tokens == got.grid[1] * got.grid[2] // 4
    assert rel_error(got.pixels, want["pixel_values"]) < 1e-6
    assert torch.equal(got.pixels, want["pixel_values"].float())


def test_a_prepared_images_digest_is_its_files_hash_under_its_bounds(monkeypatch):
    """The digest (the key of the image's embeddings and of its pads in held conversations) is the hash the file
    was kept by, taken once: the same bytes have the same one, another file or other bounds (other pixels) another
    from the first bytes on (the held keys read those); the patches are not hashed again."""
    import hashlib
    from types import SimpleNamespace

    from engine.media import image
    from engine.media.prepared import PreparedImages

    def digest(data: bytes, bounds: ImageBounds = BOUNDS) -> bytes:  # a fresh cache each: made every time
        return PreparedImages().get(data, lambda d: preprocess(data, SPEC, bounds, Norm(), "image", d),
                                    bounds.variant).digest

    def rehashed(data):
        raise AssertionError("the image module hashed the patches")

    with monkeypatch.context() as m:
        m.setattr(image, "hashlib", SimpleNamespace(sha256=rehashed))
        a = digest(FILES["png-odd"]())
    assert a == digest(FILES["png-odd"]()) == hashlib.sha256(hashlib.sha256(FILES["png-odd"]()).digest()
                                                             + BOUNDS.variant).digest()
    others = [digest(encoded(picture(101, 77, seed=5), "PNG")),
              digest(FILES["png-odd"](), ImageBounds(4 << 20, 128 * 128, 64 * 64))]
    assert len({a[:8], *(d[:8] for d in others)}) == 3


@pytest.mark.parametrize("data, message", [
    (b"not an image at all", "messages[0].content[1]: the image cannot be decoded"),
    (encoded(picture(40, 40), "PNG")[:120], "messages[0].content[1]: the image cannot be decoded"),  # cut short
    (encoded(picture(40, 40), "TIFF"), "messages[0].content[1]: image type TIFF is not supported"),
    (encoded(picture(1000, 4), "PNG"), "aspect ratio over 200"),
])
def test_bad_images_are_refused_naming_the_part(data, message):
    with pytest.raises(UserError, match=message.replace("[", r"\[").replace("]", r"\]")) as err:
        preprocess(data, SPEC, BOUNDS, Norm(), "messages[0].content[1]", b"")
    assert err.value.hint


def test_too_many_bytes_or_pixels_are_refused():
    with pytest.raises(UserError, match=r"image: the image is .* MiB, more than the 1 MiB"):
        preprocess(b"x" * (1 << 20 | 1), SPEC, ImageBounds(1 << 20, 1 << 16), Norm(), "image", b"")
    with pytest.raises(UserError, match="more than 16384 pixels"):  # 16x the 1024 an image keeps
        preprocess(encoded(picture(130, 130), "PNG"), SPEC, ImageBounds(1 << 20, 1024, 1024), Norm(), "image",
                   b"")


def smooth(w: int, h: int, mode: str = "RGB") -> PILImage.Image:
    """A picture without noise (a resize of noise depends on the filter's every detail)."""
    y, x = np.mgrid[0:h, 0:w]
    img = PILImage.fromarray(np.stack([x * 255 // w, y * 255 // h, (x + y) * 127 // (w + h)], -1).astype(np.uint8))
    if mode == "RGBA":
        img.putalpha(PILImage.fromarray((x * 255 // w).astype(np.uint8)))
    return img


def png_header(w: int, h: int) -> bytes:
    """A PNG whose header names a w x h canvas (its data is a tiny image's: decoding would fail, or cost w*h)."""
    import struct
    import zlib

    data = bytearray(encoded(picture(8, 8), "PNG"))
    ihdr = b"IHDR" + struct.pack(">II", w, h) + bytes(data[24:29])
    data[12:29] = ihdr
    data[29:33] = struct.pack(">I", zlib.crc32(ihdr))
    return bytes(data)


@pytest.mark.parametrize("w, h, message", [
    (12000, 8000, "more than 1048576 pixels"),  # a few hundred bytes naming 96 MP
    (40000, 40000, "more than 1048576 pixels"),  # over Pillow's own bound, which refuses it in open
    (1100, 1000, "more than 1048576 pixels"),  # 16x the 65536 an image keeps: the bound follows the settings
    (20000, 50, "20000x50, an aspect ratio over 200"),
])
def test_the_canvas_is_refused_from_the_header_before_decoding(w, h, message):
    with pytest.raises(UserError, match=message):
        preprocess(png_header(w, h), SPEC, BOUNDS, Norm(), "image", b"")


@pytest.mark.parametrize("fmt, mode", [("PNG", "RGBA"), ("JPEG", "RGB")])
def test_a_large_image_is_shrunk_while_decoding_close_to_the_processor(processor, fmt, mode):
    """1000x760 to 288x192: decoded at a third (JPEG's DCT scaling, `reduce`), then resized; the grid is the
    processor's and the pixels within a little of it."""
    data = encoded(smooth(1000, 760, mode), fmt, **({"quality": 95} if fmt == "JPEG" else {}))
    got = preprocess(data, SPEC, BOUNDS, Norm(), "image", b"")
    want = processor(images=PILImage.open(io.BytesIO(data)), return_tensors="pt")
    assert [list(got.grid)] == want["image_grid_thw"].tolist()
    assert (got.pixels - want["pixel_values"]).abs().mean() < 0.01


def test_at_most_two_images_decode_at_once(monkeypatch):
    import threading
    import time

    from engine.media import image

    running, most, met = [0], [0], threading.Event()
    lock = threading.Lock()
    rgb = image._rgb

    def counted(img):
        with lock:
            running[0] += 1
            most[0] = max(most[0], running[0])
            if running[0] == 2:
                met.set()
        met.wait(10)  # the first two wait for each other, however late a busy machine starts the second
        time.sleep(0.3)  # and stay a while: a third would come in meanwhile if the bound let it
        with lock:
            running[0] -= 1
        return rgb(img)

    monkeypatch.setattr(image, "_rgb", counted)
    data = encoded(picture(40, 40), "PNG")
    threads = [threading.Thread(target=preprocess, args=(data, SPEC, BOUNDS, Norm(), "image", b"")) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert most[0] == 2


def test_a_resent_image_is_prepared_once_and_the_cache_keeps_within_its_bound(vl_engine, monkeypatch):
    from engine import engine as engine_module
    from engine.media.prepared import PreparedImages

    made = []
    monkeypatch.setattr(engine_module, "preprocess", lambda data, *rest: made.append(data) or preprocess(data, *rest))
    monkeypatch.setattr(vl_engine, "prepared", PreparedImages())  # none of the session's earlier images
    a, b = encoded(picture(40, 40, seed=11), "PNG"), encoded(picture(40, 40, seed=12), "PNG")
    first = vl_engine.image(a)
    assert vl_engine.image(bytes(a), "messages[2].content[1]") is first and made == [a]  # the next turn's copy
    assert vl_engine.image(b).digest != first.digest and made == [a, b]
    with pytest.raises(UserError, match="cannot be decoded"):  # a refused file is not kept: refused again
        vl_engine.image(a[:120])
    with pytest.raises(UserError, match="cannot be decoded"):
        vl_engine.image(a[:120])
    assert len(made) == 4
    # room for two images' patches: a third pushes out the least recently used
    monkeypatch.setattr(vl_engine, "prepared", PreparedImages(2 * first.pixels.nbytes))
    c = encoded(picture(40, 40, seed=13), "PNG")
    for data in (a, b, a, c, a, b):  # b was the least recently used when c came
        vl_engine.image(data)
    assert made[4:] == [a, b, c, b] and vl_engine.prepared.made == 4


def test_the_encoders_cache_keeps_the_most_recently_used_within_its_bound():
    """Room for two images' embeddings: a third pushes out the least recently used, which the tower runs on again
    when it comes back; one request's images are all kept while it is encoded, whatever the bound."""
    from engine.media.encoder import ImageEncoder
    from engine.media.image import Image

    def tower(pixels, grids):
        return torch.full((pixels.shape[0] // 4, 8), float(pixels[0, 0]))

    a, b, c = (Image(torch.full((16, 3), float(i)), (1, 4, 4), 4, bytes([i]) * 32) for i in range(3))
    encoder = ImageEncoder(tower, torch.device("cpu"), max_patches=64, cache_bytes=2 * 4 * 8 * 4)
    for image in (a, b, a, c, a):  # b was the least recently used when c came
        assert torch.equal(encoder.encode([image]), torch.full((4, 8), float(image.pixels[0, 0])))
    assert encoder.encoded == 3
    encoder.encode([b])
    assert encoder.encoded == 4
    assert encoder.encode([a, b, c]).shape == (12, 8) and encoder.encoded == 5  # c again: b pushed it out
    encoder.encode([b])
    assert encoder.encoded == 5
