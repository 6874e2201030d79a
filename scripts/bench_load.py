"""Load time of a converted model folder (`ninfer convert`) against quantize-at-load of its source, and the time
to read the converted folder's bytes from disk, on one machine in one run.

The source is a HF folder (--model DIR) or one written here with random bf16 weights in a preset's shape
(--preset qwen3.6-27b; --layers N keeps the first N decoder layers where the disk cannot hold the 54 GB source and
its converted copy). Every timed phase but the warm one starts cold-ish: the files' pages are first written back and
dropped from the page cache (posix_fadvise DONTNEED, no root needed). The phases:
- quantize at load: the source through its loader with the formats, as the engine loads it without a converted
  folder;
- convert: `ninfer convert`'s work (once, on the CPU);
- read: the converted shards read from disk, a thread per shard (up to 8) as the loader maps them;
- converted load: with each shard's SHA-256 checked (what the engine's first load of a folder does), verified
  before (a later load: the record of verified shards lists every shard unchanged, so none is hashed), without the
  check, and checked warm (the shards still in the page cache, as a relaunch finds them).
A load ends when its weights are on the device (synchronized). The target: converted load <= 1.3x the read. With
--check (the default) the converted weights are compared bit for bit with the quantized-at-load ones (on a GPU:
the GPU's quantization against the CPU's).

Usage: python scripts/bench_load.py [--preset qwen3.6-27b | --model DIR] [--layers N] [--weights mix|q8|q5|q4|auto]
                                   [--layout tiles|rows] [--device cuda|cpu] [--workdir DIR] [--runs 2] [--keep]
       (CPU check: --preset tiny --device cpu)
-> a table, and JSON rows in scripts/results/bench_load_<gpu or cpu>.json (or $OUT/)
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import torch
from safetensors.torch import save_file

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench_util import gpu_name, write_results  # noqa: E402

from engine.config import WeightFormats  # noqa: E402
from engine.convert import convert  # noqa: E402
from engine.engine import resolve_dtype  # noqa: E402
from engine.loaders import converted, load_model  # noqa: E402
from engine.loaders.converted import load_converted  # noqa: E402
from engine.loaders.manifest import read_manifest  # noqa: E402
from engine.loaders.synthetic import random_weights  # noqa: E402
from engine.loaders.verified_shards import SETTLED_NS, FileState, VerifiedShards  # noqa: E402
from engine.models.presets import PRESETS  # noqa: E402
from engine.models.qwen3_5 import Qwen35Model, mtp_shapes  # noqa: E402
from engine.models.spec import spec_from_hf_config  # noqa: E402
from engine.quant.gguf_blocks import GGUFWeight  # noqa: E402
from engine.quant.qweight import QuantizedWeight, load_transform  # noqa: E402

# The 8k-speed profile's formats
MIX = WeightFormats(attn="q5", gdn="q5", mlp="q4", embed="q8", lm_head="q8")
_SOURCE_SHARD = 4 << 30


def write_source(folder: Path, preset: str, layers: int | None, device: torch.device) -> Path:
    """A HF folder of random bf16 weights in the preset's shape, written a tensor at a time (the whole model never
    sits in memory), shards of ~4 GiB with an index, as checkpoints come."""
    config = dict(PRESETS[preset])
    if layers:
        config["num_hidden_layers"] = layers
    spec = spec_from_hf_config(config)
    shapes = {**Qwen35Model.weight_shapes(spec), **mtp_shapes(spec)}
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps({**config, "architectures": ["Qwen3_5ForCausalLM"]}))
    if spec.vocab_size < 248077:  # the Qwen vocabulary needs room; tiny models get bytes + specials
        from engine.tokenizer.byte_level import SPECIALS, byte_level_backend

        byte_level_backend().save(str(folder / "tokenizer.json"))
        (folder / "tokenizer_config.json").write_text(json.dumps(
            {"eos_token": "<|im_end|>", "added_special_tokens": list(SPECIALS), "add_bos_token": False}))
    weight_map, shard, size, index = {}, {}, 0, 0

    def flush():
        nonlocal shard, size, index
        name = f"model-{index:05d}.safetensors"
        save_file(shard, str(folder / name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, name))
        shard, size, index = {}, 0, index + 1

    for i, (name, shape) in enumerate(shapes.items()):
        t = random_weights({name: shape}, torch.bfloat16, device, seed=i)[name].cpu()
        shard["lm_head.weight" if name == "lm_head.weight" or name.startswith("mtp.") else "model." + name] = t
        size += t.nbytes
        if size >= _SOURCE_SHARD:
            flush()
    if shard:
        flush()
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return folder


def drop_cache(paths: list[Path]) -> None:
    """Written back and dropped from the page cache: the next read comes from the disk."""
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def files_of(folder: Path) -> list[Path]:
    return sorted(p for p in folder.iterdir() if p.is_file())


def synced(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def read_files(paths: list[Path]) -> float:
    """Seconds to read the files, a thread per file (up to 8), 16 MiB at a time."""
    def read(p: Path) -> None:
        buf = bytearray(1 << 24)
        with p.open("rb", buffering=0) as f:
            while f.readinto(buf):
                pass

    start = time.perf_counter()
    with ThreadPoolExecutor(min(len(paths), 8)) as pool:
        list(pool.map(read, paths))
    return time.perf_counter() - start


def timed(fn, device: torch.device):
    start = time.perf_counter()
    out = fn()
    synced(device)
    return time.perf_counter() - start, out


@contextmanager
def unhashed(on: bool):
    """The converted load without its SHA-256 checks (what the hash costs), by patching them out here: the
    loader keeps no switch for it."""
    if not on:
        yield
        return
    check = converted._verify
    converted._verify = lambda *args: None
    try:
        yield
    finally:
        converted._verify = check


def same(a, b) -> bool:
    """Bit-for-bit equality of two loaded weights (plain, group-quantized or GGUF blocks)."""
    if isinstance(a, QuantizedWeight):
        return isinstance(b, QuantizedWeight) and a.fmt == b.fmt and a.tiled == b.tiled and \
            torch.equal(a.codes, b.codes) and torch.equal(a.scales, b.scales) and \
            (a.high is None) == (b.high is None) and (a.high is None or torch.equal(a.high, b.high))
    if isinstance(a, GGUFWeight):
        return isinstance(b, GGUFWeight) and len(a.parts) == len(b.parts) and \
            all(p.qtype == q.qtype and torch.equal(p.data, q.data) for p, q in zip(a.parts, b.parts, strict=True))
    return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    src = ap.add_mutually_exclusive_group()
    src.add_argument("--preset", choices=sorted(PRESETS), default="qwen3.6-27b",
                     help="write a random bf16 source folder of this shape (default)")
    src.add_argument("--model", help="an existing HF folder or .gguf file as the source instead")
    ap.add_argument("--layers", type=int, help="with --preset: this many decoder layers (default: the preset's)")
    ap.add_argument("--weights", default="mix", choices=["mix", "auto", "bf16", "q8", "q5", "q4"],
                    help="formats: mix = the 8k-speed profile's (q5 attention/GDN, q4 MLP, q8 embed/LM head)")
    ap.add_argument("--layout", default="tiles", choices=["tiles", "rows"],
                    help="q4/q5 layout at load (tiles: the CUDA matmuls', made where they run)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=["cuda", "cpu"])
    ap.add_argument("--workdir", help="where the source and converted folders go (default: a temporary folder)")
    ap.add_argument("--runs", type=int, default=2, help="runs of the read and converted-load phases (median)")
    ap.add_argument("--no-check", dest="check", action="store_false",
                    help="skip the bit-for-bit comparison of the two loads' weights")
    ap.add_argument("--keep", action="store_true", help="keep the folders written in --workdir")
    args = ap.parse_args()

    device = torch.device(args.device)
    dtype = resolve_dtype("auto", device)
    formats = MIX if args.weights == "mix" else WeightFormats.uniform(args.weights)
    tiled = args.layout == "tiles"
    work = Path(args.workdir or tempfile.mkdtemp(prefix="bench-load-"))
    work.mkdir(parents=True, exist_ok=True)
    made = []
    try:
        if args.model:
            source = Path(args.model)
        else:
            source = work / f"source-{args.preset}-{args.layers or 'all'}"
            if not source.exists():
                print(f"writing a random bf16 {args.preset} folder ({args.layers or 'all'} layers) to {source}",
                      file=sys.stderr)
                made.append(write_source(source, args.preset, args.layers, device))
        source_files = files_of(source) if source.is_dir() else [source]
        source_bytes = sum(p.stat().st_size for p in source_files)

        drop_cache(source_files)
        at_load_s, at_load = timed(lambda: load_model(str(source), dtype, device, load_transform(formats, tiled),
                                                      tiled=tiled).weights, device)
        if not args.check:
            del at_load
            at_load = None
        out = work / "converted"
        convert_s, _ = timed(lambda: convert(str(source), out, formats, dtype, force=True), torch.device("cpu"))
        made.append(out)
        manifest = read_manifest(out)
        shards = [out / s.name for s in manifest.shards]
        nbytes = sum(p.stat().st_size for p in shards)
        record = work / "verified-shards.json"
        time.sleep(SETTLED_NS / 1e9)  # shards written just before their hash are not recorded as verified

        reads, verified, known, unverified = [], [], [], []
        loaded = None
        for _ in range(args.runs):
            drop_cache(shards)
            reads.append(read_files(shards))
            record.unlink(missing_ok=True)  # the first load: every shard hashed, and recorded
            for hashing, times in ((True, verified), (True, known), (False, unverified)):
                loaded = None
                drop_cache(shards)
                with unhashed(not hashing):
                    seconds, loaded = timed(lambda: load_converted(out, dtype, device, tiled,
                                                                   verified_shards=record).weights, device)
                times.append(seconds)
            listed = VerifiedShards(record, out, manifest)
            if not all(listed.known(p.name, FileState.of(p.stat())) for p in shards):
                print("warning: the record does not list every shard: the 'verified before' load hashed some",
                      file=sys.stderr)
        loaded = None
        warm_s, loaded = timed(lambda: load_converted(out, dtype, device, tiled).weights, device)
        mismatched = None
        if at_load is not None:
            mismatched = sorted(k for k in at_load if k not in loaded or not same(loaded[k], at_load[k]))
            mismatched += sorted(set(loaded) - set(at_load))
        read_s = statistics.median(reads)
        rows = [
            {"phase": "quantize at load (source)", "seconds": at_load_s, "bytes": source_bytes},
            {"phase": "convert (once, CPU)", "seconds": convert_s, "bytes": source_bytes},
            {"phase": "read converted shards (cold)", "seconds": read_s, "bytes": nbytes},
            {"phase": "converted load, SHA-256 checked (cold)", "seconds": statistics.median(verified),
             "bytes": nbytes},
            {"phase": "converted load, verified before (cold)", "seconds": statistics.median(known),
             "bytes": nbytes},
            {"phase": "converted load, no hash (cold)", "seconds": statistics.median(unverified), "bytes": nbytes},
            {"phase": "converted load, SHA-256 checked (warm)", "seconds": warm_s, "bytes": nbytes},
        ]
        common = {"source": args.model or f"{args.preset} ({args.layers or 'all'} layers)",
                  "weights": formats.as_dict(), "layout": args.layout,
                  "device": gpu_name() if device.type == "cuda" else "cpu",
                  "dtype": str(dtype).removeprefix("torch."), "shards": len(shards), "cpus": os.cpu_count(),
                  "weights_equal": None if mismatched is None else not mismatched}
        for r in rows:
            r.update(common, gb_s=r["bytes"] / r["seconds"] / 1e9, vs_read=r["seconds"] / read_s)
        print(f"{common['source']} on {common['device']}, {args.weights} ({args.layout}), {len(shards)} shards, "
              f"{nbytes / 1e9:.2f} GB converted from {source_bytes / 1e9:.2f} GB")
        print(f"{'phase':42s} {'s':>8s} {'GB/s':>7s} {'x read':>7s}")
        for r in rows:
            print(f"{r['phase']:42s} {r['seconds']:8.2f} {r['gb_s']:7.2f} {r['vs_read']:7.2f}")
        if mismatched is not None:
            print("weights bit-for-bit equal to quantize-at-load: "
                  + ("yes" if not mismatched else f"NO ({len(mismatched)}: {', '.join(mismatched[:5])})"))
        path = write_results("bench_load", rows, None if device.type == "cuda" else "cpu")
        print(f"wrote {path}")
    finally:
        if not args.keep:
            for folder in made:
                shutil.rmtree(folder, ignore_errors=True)
            if not args.workdir:
                shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
