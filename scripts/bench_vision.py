"""The vision tower's encode time, tokens and peak memory on a synthetic tower of the Qwen3.5/3.6-27B's vision
shape (random weights in the compute dtype: 27 blocks of width 1152, 16 heads, MLP 4304, patch 16, 2x2 merge, out
at the text width 5120), for images of several sizes made ready by the engine's processor (issue #46's target on
an H200: a 1024x1024 image in <= 40 ms). The preprocessing (Pillow, on the host) is timed apart.

Usage: python scripts/bench_vision.py [--device cuda] [--dtype bfloat16] [--sizes 1024x1024,1920x1080,512x512]
  [--videos 10s1280x720] (a clip sampled at 2 fps as the engine does, encoded in runs of its patch bound)
  -> table + scripts/results/bench_vision_<gpu or cpu>.json (or $OUT/)
"""
from __future__ import annotations

import argparse
import io
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench_util import write_results  # noqa: E402

from engine.media.image import ImageBounds, Norm, preprocess  # noqa: E402
from engine.models.spec import vision_parameters  # noqa: E402
from engine.models.vision import VisionTower, vision_spec  # noqa: E402

QWEN36_27B_VISION = {"depth": 27, "hidden_size": 1152, "intermediate_size": 4304, "num_heads": 16,
                     "out_hidden_size": 5120, "patch_size": 16, "temporal_patch_size": 2, "spatial_merge_size": 2,
                     "num_position_embeddings": 2304, "hidden_act": "gelu_pytorch_tanh"}


def random_tower(dtype: torch.dtype, device: torch.device) -> VisionTower:
    """The tower with random weights, scaled so that activations stay O(1) through the blocks."""
    spec = vision_spec(QWEN36_27B_VISION)
    h, i, m2 = spec.hidden_size, spec.intermediate_size, spec.hidden_size * spec.spatial_merge_size ** 2
    shapes = {"patch_embed.proj.weight": (h, 3, spec.temporal_patch_size, spec.patch_size, spec.patch_size),
              "patch_embed.proj.bias": (h,), "pos_embed.weight": (spec.num_position_embeddings, h),
              "merger.norm.weight": (h,), "merger.norm.bias": (h,), "merger.linear_fc1.weight": (m2, m2),
              "merger.linear_fc1.bias": (m2,), "merger.linear_fc2.weight": (spec.out_hidden_size, m2),
              "merger.linear_fc2.bias": (spec.out_hidden_size,)}
    for b in range(spec.depth):
        p = f"blocks.{b}."
        shapes.update({p + "norm1.weight": (h,), p + "norm1.bias": (h,), p + "norm2.weight": (h,),
                       p + "norm2.bias": (h,), p + "attn.qkv.weight": (3 * h, h), p + "attn.qkv.bias": (3 * h,),
                       p + "attn.proj.weight": (h, h), p + "attn.proj.bias": (h,),
                       p + "mlp.linear_fc1.weight": (i, h), p + "mlp.linear_fc1.bias": (i,),
                       p + "mlp.linear_fc2.weight": (h, i), p + "mlp.linear_fc2.bias": (h,)})
    assert sum(int(np.prod(s)) for s in shapes.values()) == vision_parameters(QWEN36_27B_VISION)
    g = torch.Generator(device=device).manual_seed(0)
    weights = {n: (torch.randn(s, generator=g, device=device) * (s[-1] ** -0.5 if len(s) > 1 else 0.1)).to(dtype)
               for n, s in shapes.items()}
    return VisionTower(spec, weights)


def png(width: int, height: int) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(np.random.default_rng(0).integers(0, 256, (height, width, 3), dtype=np.uint8)).save(buf, "PNG")
    return buf.getvalue()


def mp4(seconds: int, width: int, height: int, fps: int = 30) -> bytes:
    """An H.264 clip of moving gradients with noise (PyAV)."""
    import av

    rng = np.random.default_rng(0)
    y, x = np.mgrid[0:height, 0:width]
    buf = io.BytesIO()
    with av.open(buf, "w", format="mp4") as out:
        stream = out.add_stream("libx264", rate=fps)
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        for i in range(seconds * fps):
            rgb = np.stack([x + i * 3, y + i * 2, (x + y) // 2 + i], -1) % 256
            rgb = (rgb + rng.integers(0, 16, rgb.shape)).clip(0, 255).astype(np.uint8)
            out.mux(stream.encode(av.VideoFrame.from_ndarray(rgb, format="rgb24")))
        out.mux(stream.encode())
    return buf.getvalue()


def video_row(tower: VisionTower, device: torch.device, runs: int, spec: str) -> dict:
    """A clip (SECONDSsWIDTHxHEIGHT) through the engine's video processor at its defaults (2 frames a second,
    video_max_pixels a frame) and its encoder (the frames in runs of the tower's patch bound)."""
    from engine.config import EngineConfig
    from engine.loaders import VideoSampling
    from engine.media.encoder import ImageEncoder
    from engine.media.video import VideoBounds, preprocess_video
    from engine.memory_plan import tower_patches

    seconds, size = spec.split("s")
    w, h = (int(x) for x in size.split("x"))
    data = mp4(int(seconds), w, h)
    c = EngineConfig("synthetic:tiny")
    bounds = VideoBounds(1 << 30, c.video_max_frames, c.video_max_pixels, c.video_decode_s)
    prep = timed(lambda: preprocess_video(data, tower.spec, bounds, VideoSampling(), Norm(), "video", b""),
                 torch.device("cpu"), max(1, runs // 5))
    video = preprocess_video(data, tower.spec, bounds, VideoSampling(), Norm(), "video", b"")
    encoder = ImageEncoder(tower, device, tower_patches(c, tower.spec.patch_size))
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
    encode = timed(lambda: encoder._run(video), device, runs)
    peak = (torch.cuda.max_memory_allocated(device) - base) if device.type == "cuda" else 0
    return {"video": spec, "frames": video.frames, "grid": list(video.grid), "tokens": video.tokens,
            "preprocess_ms": prep * 1e3, "encode_ms": encode * 1e3, "peak_activation_mib": peak / 2 ** 20}


def timed(fn, device: torch.device, runs: int) -> float:
    """Median wall seconds of fn over `runs` runs after two warm-ups, the device synchronised around each."""
    for _ in range(2):
        fn()
    times = []
    for _ in range(runs):
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    ap.add_argument("--sizes", default="1024x1024,1920x1080,512x512")
    ap.add_argument("--max-pixels", type=int, default=1 << 21, help="the engine's image_max_pixels")
    ap.add_argument("--runs", type=int, default=10)
    ap.add_argument("--videos", default="10s1280x720", help="clips SECONDSsWIDTHxHEIGHT (needs PyAV; '' for none)")
    args = ap.parse_args()
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    tower = random_tower(dtype, device)
    rows = []
    for size in args.sizes.split(","):
        w, h = (int(x) for x in size.split("x"))
        data = png(w, h)
        bounds = ImageBounds(64 << 20, args.max_pixels)
        prep = timed(lambda d=data, b=bounds: preprocess(d, tower.spec, b, Norm(), "image", b""), torch.device("cpu"),
                     args.runs)
        image = preprocess(data, tower.spec, bounds, Norm(), "image", b"")
        pixels = image.pixels.to(device)
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
            base = torch.cuda.memory_allocated(device)
        with torch.no_grad():
            encode = timed(lambda p=pixels, g=image.grid: tower(p, [g]), device, args.runs)
        peak = (torch.cuda.max_memory_allocated(device) - base) if device.type == "cuda" else 0
        rows.append({"image": size, "grid": list(image.grid), "tokens": image.tokens, "preprocess_ms": prep * 1e3,
                     "encode_ms": encode * 1e3, "peak_activation_mib": peak / 2 ** 20})
        print(f"{size:>10} grid {image.grid} {image.tokens:5d} tokens: preprocess {prep * 1e3:7.1f} ms, "
              f"encode {encode * 1e3:7.1f} ms, peak activations {peak / 2 ** 20:7.1f} MiB")
    for spec in filter(None, args.videos.split(",")):
        r = video_row(tower, device, args.runs, spec)
        rows.append(r)
        print(f"{spec:>10} {r['frames']} frames, grid {tuple(r['grid'])} {r['tokens']:5d} tokens: preprocess "
              f"{r['preprocess_ms']:7.1f} ms, encode {r['encode_ms']:7.1f} ms, peak activations "
              f"{r['peak_activation_mib']:7.1f} MiB")
    weights = sum(t.numel() * t.element_size() for t in tower.w.values())
    print(f"tower weights {weights / 2 ** 20:.0f} MiB ({args.dtype})")
    path = write_results("bench_vision", {"device": str(device), "dtype": args.dtype, "tower_weight_mib":
                                          weights / 2 ** 20, "rows": rows},
                         )
    print(path)


if __name__ == "__main__":
    main()
