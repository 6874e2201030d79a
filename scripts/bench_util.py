"""Shared by the GPU benchmarks: device-event timing, the copy bandwidth that sets the floor, random-filled
caches at a given context, the profiler's kernel times, and the results file."""
from __future__ import annotations

import json
import os
from collections import defaultdict
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent


def time_ms(fn, reps: int = 100, warmup: int = 5) -> float:
    """Median device time of `fn` over `reps` runs (CUDA events around each run)."""
    from engine.kernels.timing import median_ms

    return median_ms(fn, reps, warmup)


def time_graph_ms(fn, calls: int = 32, reps: int = 50) -> float:
    """Device time per call of `fn` replayed inside one CUDA graph of `calls` calls: what a captured decode step
    pays, without the host launch cost that per-call event timing adds to kernels of a few tens of us (the
    engine's own tile timing, without its L2 flush: benchmarks cycle weight copies instead)."""
    from engine.kernels.timing import graph_ms

    return graph_ms(fn, calls, reps)


def copy_bandwidth() -> float:
    """Bytes/s of a 1 GiB device-to-device copy (read + write), the practical HBM rate the floors use."""
    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = time_ms(lambda: dst.copy_(src), 20)
    return 2 * (1 << 30) / (ms / 1e3)


def read_rows(src: torch.Tensor, block: int = 2048) -> torch.Tensor:
    """One int32 sum per `block` words of `src` (flat int32): a kernel that only streams its input, one launch,
    one small write per program."""
    from stream_read import read_kernel

    n = src.numel()
    out = torch.empty(-(-n // block), dtype=torch.int32, device=src.device)
    read_kernel[(out.numel(),)](src, out, n, BLOCK=block, num_warps=4)
    return out


def stream_read_ms(nbytes: int, copies: int = 8) -> float:
    """Graph time of one launch that reads `nbytes` from HBM and does nothing else (`copies` buffers cycled, so
    no replay reads from L2): the practical floor of a single kernel of that size, fixed costs (launch, ramp-up,
    tail) included, which a small matmul cannot beat however well it streams."""
    bufs = [torch.randint(-2**31, 2**31 - 1, (nbytes // 4,), dtype=torch.int32, device="cuda") for _ in range(copies)]
    i = [0]

    def step():
        i[0] = (i[0] + 1) % copies
        return read_rows(bufs[i[0]])

    return time_graph_ms(step)


def fill_kv(store, g: torch.Generator) -> None:
    """Random (never zero) codes and scales in every row of a KV store."""
    for t in (store.k, store.v):
        if t.dtype == torch.int8:
            t.copy_(torch.randint(-127, 128, t.shape, generator=g, device=t.device, dtype=torch.int8))
        else:
            t.copy_(torch.randn(t.shape, generator=g, device=t.device).to(t.dtype))
    if store.quantized:
        for s in (store.k_scale, store.v_scale):
            s.copy_(torch.rand(s.shape, generator=g, device=s.device) * 0.02 + 1e-3)


def fill_cache(cache, context: int, seed: int = 0) -> None:
    """Random (never zero) KV for `context` tokens and random recurrent state: a step then reads what a real
    one would, without prefilling `context` tokens first."""
    device = cache.kv.store.k.device
    g = torch.Generator(device=device).manual_seed(seed)
    fill_kv(cache.kv.store, g)
    if cache.states is not None:
        cache.states.conv.copy_(torch.randn(cache.states.conv.shape, generator=g, device=device))
        cache.states.recurrent.copy_(torch.randn(cache.states.recurrent.shape, generator=g, device=device) * 0.1)
    cache.length = context


def gpu_name() -> str:
    return torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"


def write_results(name: str, data: list[dict] | dict, tag: str | None = None, merge_key: str | None = None) -> Path:
    """`data` as JSON in $OUT (a device call's) or scripts/results/, named `<name>_<tag>.json`; the tag defaults
    to this machine's GPU. With `merge_key`, `data`'s rows join the file's earlier ones, replacing those with a
    `merge_key` value of theirs (a benchmark writing its own rows of a file that others write too)."""
    out = Path(os.environ.get("OUT") or ROOT / "scripts" / "results")
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{name}_{(tag or gpu_name()).replace(' ', '_')}.json"
    if merge_key is not None and path.is_file():
        mine = {row.get(merge_key) for row in data}
        data = [row for row in json.loads(path.read_text()) if row.get(merge_key) not in mine] + data
    path.write_text(json.dumps(data, indent=2))
    return path


def kernel_times(prof, per: float = 1.0) -> dict[str, list[float]]:
    """Kernel name -> [device us, launches], each divided by `per` (rounds, say), from a torch profiler run with
    CUDA activity (kernels inside CUDA graphs included)."""
    times: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0])
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            times[ev.name][0] += ev.device_time / per
            times[ev.name][1] += 1 / per
    return dict(times)
