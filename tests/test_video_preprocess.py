"""Video files to the tower's input and the prompt against transformers' Qwen3-VL processor (the video processor
Qwen3.5/3.6 checkpoints name, and the processor that writes each frame's time into the prompt) on the same files:
the frames decoded with PyAV and given to transformers as an array with the video's frame count and rate (its own
readers need torchcodec or torchvision's removed video decoding); and the refusals, each naming the part and the
limit.

transformers' video processor resizes and normalises through torchvision. Where torchvision does not import (its
PyPI build does not load beside the CPU build of torch), the three functions it calls stand in as torchvision
computes them on the CPU: resize (uint8 bicubic, antialiased: `F.interpolate` on the uint8 frames), normalize
((x - mean) / std in fp32) and grayscale_to_rgb (nothing, for RGB frames)."""
import io
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from engine import VIDEO_SLOT
from engine.errors import UserError
from engine.media.image import Norm
from engine.media.prompt import expand_pads
from engine.media.video import VideoBounds, preprocess_video

from .conftest import make_video

transformers = pytest.importorskip("transformers")
av = pytest.importorskip("av")


def _torchvision_on_the_cpu():
    """torchvision's resize, normalize and grayscale_to_rgb of CPU tensors, what transformers' processor calls."""
    import enum

    import torch.nn.functional as F

    class InterpolationMode(enum.Enum):
        BILINEAR, BICUBIC, LANCZOS = "bilinear", "bicubic", "lanczos"

    def resize(image, size, interpolation=InterpolationMode.BILINEAR, antialias=True):
        *lead, c, h, w = image.shape
        if tuple(size) == (h, w):
            return image
        out = F.interpolate(image.reshape(-1, c, h, w), size=list(size), mode=interpolation.value,
                            align_corners=False, antialias=antialias)
        return out.reshape(*lead, c, *size)

    def normalize(image, mean, std, inplace=False):
        mean = torch.as_tensor(mean, dtype=image.dtype).view(-1, 1, 1)
        std = torch.as_tensor(std, dtype=image.dtype).view(-1, 1, 1)
        return (image.sub_(mean) if inplace else image.sub(mean)).div_(std)

    return SimpleNamespace(InterpolationMode=InterpolationMode, resize=resize, normalize=normalize,
                           grayscale_to_rgb=lambda image: image)


@pytest.fixture(scope="module")
def processors():
    """transformers' video processor class, and the Qwen3-VL processor class (torchvision stood in where it does not
    import; then the processor's check of its parts' classes, which looks them up where torchvision gates them,
    is left out)."""
    from transformers import image_processing_backends, video_processing_utils
    from transformers.image_utils import PILImageResampling
    from transformers.models.qwen3_vl.processing_qwen3_vl import Qwen3VLProcessor
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor
    from transformers.processing_utils import ProcessorMixin

    with pytest.MonkeyPatch.context() as mp:
        try:
            import torchvision  # noqa: F401
        except Exception:  # not installed, or its build does not load beside this torch
            tv = _torchvision_on_the_cpu()
            mp.setattr(image_processing_backends, "tvF", tv, raising=False)
            mp.setattr(video_processing_utils, "tvF", tv, raising=False)
            mp.setattr(image_processing_backends, "pil_torch_interpolation_mapping",
                       {PILImageResampling.BICUBIC: tv.InterpolationMode.BICUBIC})
            mp.setattr(ProcessorMixin, "check_argument_for_proper_class", lambda self, name, arg: type(arg))
        yield Qwen3VLVideoProcessor, Qwen3VLProcessor


def decoded(data: bytes):
    """Every frame of a video as PyAV decodes it (RGB), and its metadata as transformers' PyAV reader makes it."""
    from transformers.video_utils import VideoMetadata

    with av.open(io.BytesIO(data)) as container:
        rate = float(container.streams.video[0].average_rate)
        frames = np.stack([f.to_ndarray(format="rgb24") for f in container.decode(video=0)])
    return frames, VideoMetadata(total_num_frames=len(frames), fps=rate, duration=len(frames) / rate,
                                 video_backend="pyav", height=frames.shape[1], width=frames.shape[2])


CASES = {  # the video, and the frames and pixels per frame it may keep
    "mp4-h264": (lambda: make_video(10, 64, 48, 4), 64, 768 * 32 * 32),
    "mpeg4-shrunk": (lambda: make_video(30, 64, 48, 24, "mpeg4", seed=1), 6, 16 * 64),  # 6 of 30, to 32x32
    "webm-vp9-no-frame-count": (lambda: make_video(9, 40, 24, 3, "libvpx-vp9", "webm", seed=2), 64, 768 * 32 * 32),
    "avi-odd-frames": (lambda: make_video(7, 36, 52, 2, "mpeg4", "avi", seed=3), 64, 768 * 32 * 32),
}


@pytest.mark.parametrize("name", list(CASES))
def test_pixels_grid_and_prompt_equal_the_transformers_processor(vl_folder, vl_engine, processors, name):
    from transformers import AutoTokenizer
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    make, max_frames, frame_pixels = CASES[name]
    data = make()
    v = vl_engine.vision
    spec, sampling = v.spec, v.video
    got = preprocess_video(data, spec, VideoBounds(1 << 20, max_frames, frame_pixels, 60), sampling,
                           Norm(v.mean, v.std), "video", b"")
    factor = spec.patch_size * spec.spatial_merge_size
    video_processor = processors[0](
        patch_size=spec.patch_size, temporal_patch_size=spec.temporal_patch_size, merge_size=spec.spatial_merge_size,
        image_mean=list(v.mean), image_std=list(v.std), fps=sampling.fps, min_frames=sampling.min_frames,
        max_frames=min(sampling.max_frames, max_frames), cap_pixels_per_frame=True,
        max_video_tokens=frame_pixels // factor ** 2,
        size={"shortest_edge": sampling.min_pixels, "longest_edge": sampling.max_pixels})
    processor = processors[1](image_processor=Qwen2VLImageProcessorPil(), tokenizer=AutoTokenizer.from_pretrained(
        str(vl_folder)), video_processor=video_processor)
    frames, metadata = decoded(data)
    text = "<|im_start|>user\nWatch: <|vision_start|><|video_pad|><|vision_end|>What happens?<|im_end|>\n"
    want = processor(text=[text], videos=[frames], video_metadata=[metadata], return_tensors="pt")
    assert [list(got.grid)] == want["video_grid_thw"].tolist()
    assert torch.equal(got.pixels, want["pixel_values_videos"])
    ids = vl_engine.encode_rendered(text.replace("<|vision_start|><|video_pad|><|vision_end|>", VIDEO_SLOT), [got])
    assert expand_pads(ids, (v.image_token_id, v.video_token_id), [got]) == want["input_ids"][0].tolist()


def test_the_frames_taken_follow_the_rate_and_the_bounds(vl_engine):
    """At 2 frames a second of video: 4 of a 1-second clip (the fewest the processor takes), 10 of 5 s at 24 fps
    spread over all of it, 6 where the bound is 6; each temporal patch's time is the middle of its two frames'."""
    v = vl_engine.vision

    def frames(data: bytes, max_frames: int = 64):
        video = preprocess_video(data, v.spec, VideoBounds(1 << 20, max_frames, 4096, 60), v.video, Norm(), "video",
                                 b"")
        return video.frames, video.timestamps

    assert frames(make_video(8, fps=8)) == (4, pytest.approx(((0 + 2) / 16, (5 + 7) / 16)))  # frames 0, 2, 5, 7
    assert frames(make_video(120, 32, 32, 24, "mpeg4"))[0] == 10
    # frames 0, 24, 48, 71, 95, 119
    assert frames(make_video(120, 32, 32, 24, "mpeg4"), 6) == (6, pytest.approx((24 / 48, 119 / 48, 214 / 48)))


def test_the_same_video_has_the_same_digest_and_another_another(vl_engine):
    """Another file, or the same one sampled within another frame budget, has another digest from its first bytes
    on (a held conversation's pad keys read those)."""
    data = make_video(seed=4)  # once: an encoder's output may vary between runs, which is not what is tested here
    a, b = vl_engine.video(data), vl_engine.video(bytes(bytearray(data)))
    others = [vl_engine.video(make_video(seed=5)).digest, vl_engine.video(data, max_frames=4).digest]
    assert a.digest == b.digest and len({a.digest[:8], *(d[:8] for d in others)}) == 3


def png() -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (16, 16)).save(buf, "PNG")
    return buf.getvalue()


def audio_only() -> bytes:
    buf = io.BytesIO()
    with av.open(buf, "w", format="mp4") as out:
        stream = out.add_stream("aac", rate=8000)
        frame = av.AudioFrame.from_ndarray(np.zeros((1, 1024), dtype=np.float32), format="fltp", layout="mono")
        frame.sample_rate = 8000
        out.mux(stream.encode(frame))
        out.mux(stream.encode())
    return buf.getvalue()


@pytest.mark.parametrize("data, message", [
    (lambda: b"not a video at all", "the video's container is not supported"),
    (png, "the video's container is not supported"),
    (lambda: make_video()[:300], "the video cannot be decoded"),  # cut short
    (lambda: b"\0\0\0\x18ftypisom" + b"\0" * 200, "the video cannot be decoded"),
    (audio_only, "the file has no video stream"),
    (lambda: make_video(1), "the video has 1 frame, fewer than the 2 of a temporal patch"),
    (lambda: make_video(2, 840, 4), "the video is 840x4: an aspect ratio over 200"),
    (lambda: make_video(2, 1040, 64), "the video's frames have more than 65536 pixels"),  # 16x what one keeps
])
def test_bad_videos_are_refused_naming_the_part(vl_engine, data, message):
    v = vl_engine.vision
    bounds = VideoBounds(1 << 20, 64, 4096, 60)
    with pytest.raises(UserError, match=message.replace("[", r"\[").replace("]", r"\]")) as err:
        preprocess_video(data(), v.spec, bounds, v.video, Norm(), "messages[0].content[1]", b"")
    assert str(err.value).startswith("messages[0].content[1]: ") and err.value.hint


def test_too_many_bytes_or_frames_are_refused(vl_engine, monkeypatch):
    from engine.media import video

    v = vl_engine.vision
    with pytest.raises(UserError, match=r"video: the video is .* MiB, more than the 1 MiB a video may be"):
        preprocess_video(b"x" * (1 << 20 | 1), v.spec, VideoBounds(1 << 20, 64, 4096, 60), v.video, Norm(), "video",
                         b"")
    monkeypatch.setattr(video, "MAX_SOURCE_FRAMES", 20)
    for clip in (make_video(24, 16, 16), make_video(24, 16, 16, 4, "libvpx-vp9", "webm")):  # the header's, counted
        with pytest.raises(UserError, match="the video has more than the 20 frames this server decodes"):
            preprocess_video(clip, v.spec, VideoBounds(1 << 20, 64, 4096, 60), v.video, Norm(), "video", b"")


def test_a_decode_past_video_decode_s_is_refused_and_frees_its_slot(vl_engine, monkeypatch):
    """A clock that runs 10 s a look makes the decode slow: the engine's video_decode_s (5 here) refuses it naming
    the part and the setting, and the decoding slot it held is free again (a video decodes in time after it)."""
    import dataclasses
    import itertools

    from engine.media import video
    from engine.media.image import DECODING

    clip = make_video(8, seed=11)  # a file no other test prepares: decoded here, not taken from the cache
    monkeypatch.setattr(vl_engine, "config", dataclasses.replace(vl_engine.config, video_decode_s=5))
    with monkeypatch.context() as slow:
        slow.setattr(video, "monotonic", itertools.count(0, 10).__next__)
        with pytest.raises(UserError, match=r"messages\[0\]\.content\[1\]: the video took more than the 5 s this "
                                            r"server gives one video's decoding \(video_decode_s\)") as err:
            vl_engine.video(clip, "messages[0].content[1]")
    assert "shorter clip" in err.value.hint
    assert DECODING.acquire(blocking=False) and DECODING.acquire(blocking=False)
    DECODING.release()
    DECODING.release()
    assert vl_engine.video(clip).frames == 4  # 2 s of video at the checkpoint's 2 frames a second
