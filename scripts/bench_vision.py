"""The vision tower's encode time, tokens and peak memory on a synthetic tower of the Qwen3.5/3.6-27B's vision
shape (random weights in the compute dtype: 27 blocks of width 1152, 16 heads, MLP 4304, patch 16, 2x2 merge, out
at the text width 5120), for images of several sizes made ready by the engine's processor (issue #46's target on
an H200: a 1024x1024 image in <= 40 ms). The preprocessing (Pillow, on the host) is timed apart.

With --ttft, also the time to first token of a chat turn with one screenshot (issue #46's other target), on a
synthetic vision-language model the engine loads (by default the 27B with that tower, in the 8k-speed profile's
formats: q5/q4 weights, int8 KV, 2048-token prefill chunks, an 8K context; the engine's image bound, 1 MP): a PNG
like a screenshot (flat panels, lines of text-like noise, a photo) and a short question, timed from the file's
bytes (the image made ready, the prompt encoded, the tower run where its cache lacks the image, the prefill) to the
first token, the median of --ttft-runs runs of each:
  cold         a new image in a new conversation
  resent       the same image in another conversation (the tower's cache serves it; the prompt prefills whole)
  second-turn  the conversation's next turn after a reply, the image sent again (the held conversation serves it)

Usage: python scripts/bench_vision.py [--device cuda] [--dtype bfloat16] [--sizes 1024x1024,1920x1080,512x512]
  [--videos 10s1280x720] (a clip sampled at 2 fps as the engine does, encoded in runs of its patch bound)
  [--ttft [--model synthetic:qwen3.6-27b-vl] [--weights q5/q4] [--kv int8] [--ttft-image 1920x1080]]
  ('' for --sizes or --videos measures none)
  -> table + scripts/results/bench_vision_<gpu or cpu>.json (or $OUT/): this run's rows, and the rows of the file in
  scripts/results/ that it did not measure again
"""
from __future__ import annotations

import argparse
import io
import json
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench_util import gpu_name, write_results  # noqa: E402

from engine import IMAGE_SLOT, Engine, EngineConfig, SamplingParams, TokenEvent  # noqa: E402
from engine.config import WeightFormats  # noqa: E402
from engine.loaders.synthetic import random_tower  # noqa: E402
from engine.media.image import ImageBounds, Norm, preprocess  # noqa: E402
from engine.models.presets import QWEN36_27B_VISION  # noqa: E402
from engine.models.vision import VisionTower, vision_spec  # noqa: E402

WEIGHTS = {"auto": WeightFormats(), "q5/q4": WeightFormats(attn="q5", gdn="q5", mlp="q4", embed="q8", lm_head="q8")}
TTFT_SCENARIOS = ("cold", "resent", "second-turn")
QUESTION = "What is on this screen? Answer in one sentence."
OTHER_QUESTION = "Which application is this a screenshot of?"
FOLLOW_UP = "And what should I click next?"
REPLY = 8  # tokens a turn generates: the second turn continues after them
DECODE = 64  # tokens a reply decodes for its rate: after a prompt with the screenshot, and after text alone


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


def screenshot(width: int, height: int, seed: int) -> bytes:
    """A PNG like a desktop screenshot: flat panels (a title bar, a sidebar, a page), lines of text-like noise on
    the page (dark pixels in word-long runs), and a photo (a gradient with noise); each seed a different file."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    img = np.full((height, width, 3), 246, np.uint8)
    bar, side, gap, line = max(1, height // 25), width // 6, max(2, height // 45), max(2, height // 80)
    img[:bar] = (40, 42, 48)
    img[bar:, :side] = (226, 229, 234)
    left, photo_top = side + gap, height * 2 // 3
    for top in range(bar + gap, photo_top - line, line + gap):
        words = np.repeat(rng.random(width // 8 + 1) < 0.8, 8)[: width - left - gap]
        words[int(words.size * rng.uniform(0.3, 1.0)):] = False  # a line ends before the page does
        ink = (rng.random((line, words.size)) < 0.45) & words
        img[top:top + line, left:left + words.size][ink] = rng.integers(0, 90, 3)
    ph, pw = height - photo_top - gap, width * 2 // 3 - left
    if ph > 0 and pw > 0:
        y, x = np.mgrid[0:ph, 0:pw]
        photo = np.stack([x * 255 / pw, y * 255 / ph, (x + y) * 128 / (pw + ph) + 64], -1)
        photo += rng.normal(0, 12, photo.shape)
        img[photo_top:photo_top + ph, left:left + pw] = photo.clip(0, 255).astype(np.uint8)
    buf = io.BytesIO()
    Image.fromarray(img).save(buf, "PNG")
    return buf.getvalue()


@dataclass
class Turn:
    ttft: float
    ids: list[int]  # the prompt, the image's pad once
    reply: list[int]
    image_tokens: int
    prompt_tokens: int  # the image's pads expanded
    cached_tokens: int  # served from a held conversation
    tower_runs: int  # images the tower encoded (the rest came from its cache)


def chat_turn(eng: Engine, data: bytes, history: list[int], text: str) -> Turn:
    """A chat turn sending the image file `data`, timed from its bytes to the first token: a new conversation of
    one message (the image, then `text`) when `history` is empty, else the next user message (`text`) after
    `history`'s exact ids (the image is in them), as a client that keeps a conversation's tokens sends it."""
    encoded = eng.images.encoded
    t0 = time.perf_counter()
    images = eng.media([("image", data, False)])
    if history:
        ids = history + eng.tokenizer.encode("<|im_end|>\n" + eng.render_chat([{"role": "user", "content": text}]))
    else:
        ids = eng.encode_chat([{"role": "user", "content": IMAGE_SLOT + text}], media=images)
    ttft, final = None, None
    for event in eng.submit(ids, SamplingParams(max_tokens=REPLY, temperature=0, ignore_eos=True), images):
        if ttft is None and isinstance(event, TokenEvent):
            ttft = time.perf_counter() - t0
        final = event
    return Turn(ttft, ids, final.token_ids, images[0].tokens, eng.prompt_tokens(ids, images), final.cached_tokens,
                eng.images.encoded - encoded)


def decode_rate(eng: Engine, ids: list[int], images: list) -> float:
    """Tokens a second of a DECODE-token reply after its first token (greedy, no drafter)."""
    first = last = None
    for event in eng.submit(ids, SamplingParams(max_tokens=DECODE, temperature=0, ignore_eos=True), images):
        if isinstance(event, TokenEvent):
            last = time.perf_counter()
            first = first or last
    return (DECODE - 1) / (last - first)


def decode_rows(eng: Engine, args: argparse.Namespace, data: bytes) -> list[dict]:
    """The decode rate of a reply in a conversation with the screenshot against one with text alone of the same
    prompt length (a request with images decodes in the graph lanes past its prompt, as text does)."""
    images = eng.media([("image", data, False)])
    ids = eng.encode_chat([{"role": "user", "content": IMAGE_SLOT + QUESTION}], media=images)
    text = torch.randint(min(1000, eng.geometry.vocab_size // 2), min(20000, eng.geometry.vocab_size),
                         (eng.prompt_tokens(ids, images),), generator=torch.Generator().manual_seed(0))
    rows = []
    for scenario, prompt, media in (("decode-image", ids, images), ("decode-text", text.tolist(), [])):
        eng.drop_held()
        decode_rate(eng, prompt, media)  # first-use costs
        rate = statistics.median(decode_rate(eng, prompt, media) for _ in range(args.ttft_runs))
        rows.append({"scenario": scenario, "image": args.ttft_image if media else None, "decode_tok_s": rate,
                     "reply_tokens": DECODE, "gpu": gpu_name(), "model": args.model, "weights": args.weights,
                     "kv_dtype": args.kv})
        print(f"{scenario:>12} {args.ttft_image if media else 'text':>9}: {rate:7.1f} tok/s decoding a "
              f"{DECODE}-token reply")
    return rows


def ttft_rows(args: argparse.Namespace, device: torch.device) -> list[dict]:
    """The --ttft scenarios' rows: each run a new screenshot, its first turn (cold), the conversation's second
    turn (second-turn), and the image in a new conversation with no conversation held (resent)."""
    w, h = (int(x) for x in args.ttft_image.split("x"))
    eng = Engine(EngineConfig(args.model, device=device.type, dtype=args.dtype, weights=WEIGHTS[args.weights],
                              kv_dtype=args.kv, max_context=args.max_context, prefill_chunk=args.chunk,
                              image_max_pixels=args.ttft_max_pixels))

    def run(seed: int) -> dict[str, Turn]:
        data = screenshot(w, h, seed)
        eng.drop_held()
        cold = chat_turn(eng, data, [], QUESTION)
        second = chat_turn(eng, data, cold.ids + cold.reply, FOLLOW_UP)
        eng.drop_held()  # the prompt prefills whole: only the tower's cache serves
        return {"cold": cold, "second-turn": second, "resent": chat_turn(eng, data, [], OTHER_QUESTION)}

    run(args.ttft_runs)  # first-use costs (kernel compilation, allocations), on an image no timed run sends
    runs = [run(seed) for seed in range(args.ttft_runs)]
    decoding = decode_rows(eng, args, screenshot(w, h, args.ttft_runs))
    eng.close()
    rows = []
    for scenario in TTFT_SCENARIOS:
        turns = [r[scenario] for r in runs]
        first = turns[0]
        rows.append({"scenario": scenario, "image": args.ttft_image, "ttft_s": statistics.median(t.ttft for t in turns),
                     "ttft_runs_s": [t.ttft for t in turns], "image_tokens": first.image_tokens,
                     "prompt_tokens": first.prompt_tokens, "cached_tokens": first.cached_tokens,
                     "tower_runs": first.tower_runs, "gpu": gpu_name(), "model": args.model, "weights": args.weights,
                     "kv_dtype": args.kv, "prefill_chunk": args.chunk})
        print(f"{scenario:>12} {args.ttft_image} ({first.image_tokens} image tokens, {first.prompt_tokens} in the "
              f"prompt, {first.cached_tokens} cached, tower runs {first.tower_runs}): time to first token "
              f"{rows[-1]['ttft_s'] * 1e3:8.1f} ms")
    return rows + decoding


def with_earlier(data: dict) -> dict:
    """`data` with the rows of this GPU's file in scripts/results/ that this run did not measure again (a run of
    --ttft alone keeps the tower's rows)."""
    path = ROOT / "scripts" / "results" / f"bench_vision_{gpu_name().replace(' ', '_')}.json"
    if not path.is_file():
        return data
    earlier = json.loads(path.read_text())

    def key(row: dict) -> tuple:
        return row.get("scenario"), row.get("image"), row.get("video")

    again = {key(r) for r in data["rows"]}
    return {**earlier, **data, "rows": [r for r in earlier["rows"] if key(r) not in again] + data["rows"]}


def image_row(tower: VisionTower, device: torch.device, runs: int, size: str, max_pixels: int) -> dict:
    """An image of noise (WIDTHxHEIGHT) through the processor at `max_pixels`, and the tower."""
    w, h = (int(x) for x in size.split("x"))
    data = png(w, h)
    bounds = ImageBounds(64 << 20, max_pixels)
    prep = timed(lambda: preprocess(data, tower.spec, bounds, Norm(), "image", b""), torch.device("cpu"), runs)
    image = preprocess(data, tower.spec, bounds, Norm(), "image", b"")
    pixels = image.pixels.to(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
    with torch.no_grad():
        encode = timed(lambda: tower(pixels, [image.grid]), device, runs)
    peak = (torch.cuda.max_memory_allocated(device) - base) if device.type == "cuda" else 0
    print(f"{size:>10} grid {image.grid} {image.tokens:5d} tokens: preprocess {prep * 1e3:7.1f} ms, "
          f"encode {encode * 1e3:7.1f} ms, peak activations {peak / 2 ** 20:7.1f} MiB")
    return {"image": size, "grid": list(image.grid), "tokens": image.tokens, "preprocess_ms": prep * 1e3,
            "encode_ms": encode * 1e3, "peak_activation_mib": peak / 2 ** 20}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    ap.add_argument("--sizes", default="1024x1024,1920x1080,512x512", help="images WIDTHxHEIGHT ('' for none)")
    ap.add_argument("--max-pixels", type=int, default=1 << 21, help="the tower rows' image bound (image_max_pixels)")
    ap.add_argument("--runs", type=int, default=10)
    ap.add_argument("--videos", default="10s1280x720", help="clips SECONDSsWIDTHxHEIGHT (needs PyAV; '' for none)")
    ttft = ap.add_argument_group("time to first token (--ttft)")
    ttft.add_argument("--ttft", action="store_true", help="time chat turns with a screenshot on a model")
    ttft.add_argument("--model", default="synthetic:qwen3.6-27b-vl", help="a vision-language model")
    ttft.add_argument("--weights", default="q5/q4", choices=sorted(WEIGHTS))
    ttft.add_argument("--kv", default="int8", help="kv_dtype")
    ttft.add_argument("--chunk", type=int, default=2048, help="prefill_chunk")
    ttft.add_argument("--max-context", type=int, default=8192)
    ttft.add_argument("--ttft-image", default="1920x1080", help="the screenshot, WIDTHxHEIGHT")
    ttft.add_argument("--ttft-max-pixels", type=int, default=EngineConfig.image_max_pixels,
                      help="the engine's image_max_pixels (default: the engine's)")
    ttft.add_argument("--ttft-runs", type=int, default=3)
    args = ap.parse_args()
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    data = {"device": str(device), "dtype": args.dtype, "rows": []}
    sizes, videos = list(filter(None, args.sizes.split(","))), list(filter(None, args.videos.split(",")))
    if sizes or videos:
        spec = vision_spec(QWEN36_27B_VISION)
        tower = VisionTower(spec, random_tower(spec, dtype, device))
        data["rows"] += [image_row(tower, device, args.runs, size, args.max_pixels) for size in sizes]
        for clip in videos:
            r = video_row(tower, device, args.runs, clip)
            data["rows"].append(r)
            print(f"{clip:>10} {r['frames']} frames, grid {tuple(r['grid'])} {r['tokens']:5d} tokens: preprocess "
                  f"{r['preprocess_ms']:7.1f} ms, encode {r['encode_ms']:7.1f} ms, peak activations "
                  f"{r['peak_activation_mib']:7.1f} MiB")
        data["tower_weight_mib"] = sum(t.numel() * t.element_size() for t in tower.w.values()) / 2 ** 20
        print(f"tower weights {data['tower_weight_mib']:.0f} MiB ({args.dtype})")
        del tower  # its memory back before a model loads
        if device.type == "cuda":
            torch.cuda.empty_cache()
    if args.ttft:
        data["rows"] += ttft_rows(args, device)
    print(write_results("bench_vision", with_earlier(data)))


if __name__ == "__main__":
    main()
