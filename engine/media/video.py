"""A video file's bytes -> the vision tower's input, as transformers' Qwen3-VL video processor (the one Qwen3.5/3.6
checkpoints name) makes it from the frames PyAV decodes: frames taken evenly over the whole video, `fps` of them
per second of it (at least `min_frames`, at most `max_frames` and the video's own), resized to one size on the
patch grid (bicubic, antialiased, in uint8: torchvision's resize of uint8 frames on the CPU), normalised, and cut
into patches of `temporal_patch_size` consecutive frames (the last frame repeated to fill the last one). Each frame
keeps at most `frame_pixels` (the reference implementation's per-frame cap, qwen-vl-utils', which transformers
applies with `cap_pixels_per_frame`), and all of them together the checkpoint's pixel budget. Each temporal patch
has a time, the middle of its frames', which the prompt writes before it ("<1.5 seconds>").

Every way a video can be refused is a UserError naming the part (`where`) and the limit: a container other than
MP4/MOV, Matroska/WebM or AVI (told from the bytes, so that FFmpeg probes no other format), not decodable, no video
stream, a canvas too large or too thin, more frames than this server decodes, a decode that outlasts its time (it
holds one of the slots every request's images and videos decode in), fewer than one temporal patch, frames that
change size. Only the frames taken are converted to RGB, and each is resized as it is decoded.
"""
from __future__ import annotations

import io
import math
from dataclasses import dataclass
from itertools import islice
from time import monotonic

import numpy as np
import torch
import torch.nn.functional as F

from ..errors import UserError
from ..loaders import VideoSampling
from ..models.vision import VisionSpec
from . import video_container
from .image import DECODE_FACTOR, DECODING, MAX_ASPECT, MAX_DECODE_PIXELS, Image, Norm

# A video's source frames are all decoded (the codecs' frames depend on each other): a bound on the work of one
# file, ten minutes at 30 frames per second
MAX_SOURCE_FRAMES = 18_000
CONTAINERS = "MP4/MOV, WebM/MKV or AVI"


@dataclass(frozen=True)
class VideoBounds:
    """What one video may cost: `max_bytes` of file, `max_frames` taken from it, `frame_pixels` per frame after
    resizing (larger ones shrink to it), `decode_s` seconds of decoding; `decode_pixels` guards the decoder itself."""

    max_bytes: int
    max_frames: int
    frame_pixels: int
    decode_s: float

    @property
    def decode_pixels(self) -> int:
        return min(DECODE_FACTOR * self.frame_pixels, MAX_DECODE_PIXELS)

    @property
    def variant(self) -> bytes:
        """The bounds that shape what a file makes, for its digest (`PreparedImages.get`)."""
        return f"video {self.max_frames} {self.frame_pixels}".encode()


@dataclass(frozen=True)
class Video(Image):
    """A video ready for the tower: an Image whose grid has `grid[0]` temporal patches, each of which the prompt
    holds as one frame (its time, then its pads between the vision markers)."""

    timestamps: tuple[float, ...] = ()  # seconds: the middle of each temporal patch's frames
    frames: int = 0  # taken from the file (the last temporal patch may repeat its last one)


def sample_indices(total: int, video_fps: float, sampling: VideoSampling, max_frames: int) -> np.ndarray:
    """The indices of the frames taken from a video of `total` frames at `video_fps`: the processor's count
    (`sampling.fps` per second, within its bounds and `max_frames`), spread evenly from the first to the last."""
    n = int(total / video_fps * sampling.fps)
    n = min(max(n, sampling.min_frames), sampling.max_frames, max_frames, total)
    return np.linspace(0, total - 1, n).round().astype(int)


def frame_size(frames: int, height: int, width: int, spec: VisionSpec, frame_pixels: int,
               sampling: VideoSampling) -> tuple[int, int]:
    """(height, width) every frame is resized to: both multiples of the merge block's side, the pixels of the
    temporal patches' frames within the per-frame cap and the checkpoint's budget, the aspect ratio kept as well as
    that allows. ValueError for a video it cannot size."""
    factor, tp = spec.patch_size * spec.spatial_merge_size, spec.temporal_patch_size
    if frames < tp:
        raise ValueError(f"{frames} frames, fewer than the {tp} of a temporal patch")
    per_frame = max(min(frame_pixels, sampling.max_pixels // frames), int(sampling.min_pixels * 1.05))
    max_pixels = per_frame * frames
    if height < factor or width < factor:
        scale = max(factor / height, factor / width)
        height, width = int(height * scale), int(width * scale)
    if max(height, width) / min(height, width) > MAX_ASPECT:
        raise ValueError(f"an aspect ratio over {MAX_ASPECT}")
    h, w = round(height / factor) * factor, round(width / factor) * factor
    t = round(frames / tp) * tp
    if t * h * w > max_pixels:
        beta = math.sqrt(frames * height * width / max_pixels)
        h = max(factor, math.floor(height / beta / factor) * factor)
        w = max(factor, math.floor(width / beta / factor) * factor)
    elif t * h * w < sampling.min_pixels:
        beta = math.sqrt(sampling.min_pixels / (frames * height * width))
        h, w = math.ceil(height * beta / factor) * factor, math.ceil(width * beta / factor) * factor
    return h, w


def timestamps(indices: list[int], video_fps: float, tp: int) -> tuple[float, ...]:
    """Each temporal patch's time: the mean of its first and last frames' (the last frame repeated to fill the
    last patch, as its pixels are)."""
    indices = indices + [indices[-1]] * (-len(indices) % tp)
    seconds = [i / video_fps for i in indices]
    return tuple((seconds[i] + seconds[i + tp - 1]) / 2 for i in range(0, len(seconds), tp))


def preprocess_video(data: bytes, spec: VisionSpec, bounds: VideoBounds, sampling: VideoSampling, norm: Norm,
                     where: str, digest: bytes) -> Video:
    """A video file's bytes as the tower's input under `digest` (`PreparedImages` gives its file's); UserError
    naming `where` (the request part) when it is refused."""
    if len(data) > bounds.max_bytes:
        raise UserError(f"{where}: the video is {len(data) / 2**20:.1f} MiB, more than the "
                        f"{bounds.max_bytes / 2**20:.0f} MiB a video may be",
                        hint="send a shorter or more compressed video")
    demuxer = video_container(data)
    if demuxer is None:
        raise UserError(f"{where}: the video's container is not supported", hint=f"send an {CONTAINERS} file")
    with DECODING:  # released however the decode ends: in time, refused or past its deadline
        deadline = monotonic() + bounds.decode_s
        try:
            frames, indices, fps = _frames(data, demuxer, spec, bounds, sampling, where, deadline)
        except UserError:
            raise
        except Exception as exc:  # FFmpeg's errors (and PyAV's own) for a bad file; each is the client's bad video
            raise UserError(f"{where}: the video cannot be decoded ({type(exc).__name__})",
                            hint=f"send a valid {CONTAINERS} file") from None
    return _tower_input(frames, indices, fps, spec, norm, digest)


def _frames(data: bytes, demuxer: str, spec: VisionSpec, bounds: VideoBounds, sampling: VideoSampling,
            where: str, deadline: float) -> tuple[torch.Tensor, list[int], float]:
    """The frames taken, resized ([n, 3, h, w] uint8), their indices and the video's frame rate; UserError once
    the decode passes `deadline` (`monotonic()`'s clock)."""
    import av

    with av.open(io.BytesIO(data), format=demuxer) as container:
        if not container.streams.video:
            raise UserError(f"{where}: the file has no video stream", hint="send a video with pictures")
        stream = container.streams.video[0]
        rate = float(stream.average_rate or 0)
        _check_canvas(stream.height, stream.width, bounds, where)
        # a header without the count (WebM's): the stream's packets, a frame each, counted past the bound at most
        total = stream.frames or sum(1 for _ in islice((p for p in container.demux(stream) if p.size),
                                                        MAX_SOURCE_FRAMES + 1))
    if total > MAX_SOURCE_FRAMES:
        raise UserError(f"{where}: the video has more than the {MAX_SOURCE_FRAMES} frames this server decodes",
                        hint="send a shorter clip")
    if rate <= 0:
        raise UserError(f"{where}: the video has no frame rate", hint="send a video with a constant frame rate")
    if total < spec.temporal_patch_size:
        raise UserError(f"{where}: the video has {total} frame{'s' * (total != 1)}, fewer than the "
                        f"{spec.temporal_patch_size} of a temporal patch", hint="send a longer clip")
    wanted = sample_indices(total, rate, sampling, bounds.max_frames).tolist()
    taken, frames, first, size = set(wanted), [], None, (0, 0)
    with av.open(io.BytesIO(data), format=demuxer) as container:
        for i, frame in enumerate(container.decode(video=0)):
            if i > wanted[-1]:
                break
            if monotonic() > deadline:  # a frame's decode is bounded by the canvas, their count by the clock
                raise UserError(f"{where}: the video took more than the {bounds.decode_s:g} s this server gives one "
                                "video's decoding (video_decode_s)",
                                hint="send a shorter clip or one of smaller frames, or raise video_decode_s")
            if first is None:  # sized for the frames the header promises, as the processor sizes them
                first = (frame.height, frame.width)
                _check_canvas(*first, bounds, where)
                size = _size(len(wanted), *first, spec, bounds, sampling, where)
            elif (frame.height, frame.width) != first:  # each frame: the canvas is bounded by the first's
                raise UserError(f"{where}: the video's frames change size", hint="send a video of one frame size")
            if i in taken:
                frames.append(_resized(torch.from_numpy(frame.to_ndarray(format="rgb24")).permute(2, 0, 1), size))
    found = len(frames)  # a header may promise more frames than the stream holds: those found are the video
    if found < spec.temporal_patch_size:
        raise UserError(f"{where}: the video has {found} decodable frame{'s' * (found != 1)} where its header "
                        f"says {total}", hint="send a complete video file")
    return torch.stack(frames), wanted[:found], rate


def _check_canvas(height: int, width: int, bounds: VideoBounds, where: str) -> None:
    if height * width > bounds.decode_pixels:
        raise UserError(f"{where}: the video's frames have more than {bounds.decode_pixels} pixels",
                        hint="send a video of a smaller size")


def _size(frames: int, height: int, width: int, spec: VisionSpec, bounds: VideoBounds, sampling: VideoSampling,
          where: str) -> tuple[int, int]:
    try:
        return frame_size(frames, height, width, spec, bounds.frame_pixels, sampling)
    except ValueError as exc:
        raise UserError(f"{where}: the video is {width}x{height}: {exc}", hint="send a video closer to a "
                        "rectangle") from None


def _resized(frame: torch.Tensor, size: tuple[int, int]) -> torch.Tensor:
    """A [3, H, W] uint8 frame at `size` (height, width): torchvision's resize of uint8 on the CPU (the frame as
    it is where its size is kept)."""
    if tuple(frame.shape[1:]) == size:
        return frame
    return F.interpolate(frame[None], size=list(size), mode="bicubic", align_corners=False, antialias=True)[0]


def _tower_input(frames: torch.Tensor, indices: list[int], fps: float, spec: VisionSpec, norm: Norm,
                 digest: bytes) -> Video:
    """Frames [n, 3, h, w] uint8 normalised (in fp32, as the processor: (x - 255 mean) / (255 std)) and cut into
    patches in merge-block order, each patch's pixels channels-first over its temporal patch's frames."""
    p, m, tp = spec.patch_size, spec.spatial_merge_size, spec.temporal_patch_size
    mean = (torch.tensor(norm.mean) * (1.0 / (1 / 255)))[:, None, None]
    std = (torch.tensor(norm.std) * (1.0 / (1 / 255)))[:, None, None]
    if pad := -len(frames) % tp:  # the last frame again, to fill the last temporal patch
        frames = torch.cat([frames, frames[-1:].expand(pad, -1, -1, -1)])
    pixels = (frames.float() - mean) / std
    n, c, height, width = pixels.shape
    gt, gh, gw = n // tp, height // p, width // p
    patches = pixels.view(gt, tp, c, gh // m, m, p, gw // m, m, p).permute(0, 3, 6, 4, 7, 2, 1, 5, 8)
    flat = patches.reshape(gt * gh * gw, c * tp * p * p).contiguous()
    return Video(flat, (gt, gh, gw), gt * gh * gw // m ** 2, digest, timestamps(indices, fps, tp), len(indices))
