"""Would one persistent kernel per step read the T=1 step's weights nearer the bandwidth floor than a launch per
matmul? The question behind the 1.15x target (lab notes (25): ~700 small launches and the gaps between them cost
~2.3 ms of the 6.15 ms step; fusing neighbours is worth 0.02-0.1 ms each), asked of the memory system alone:
kernels that only read (and sum) the 27B's T=1 weights, matrix by matrix in the step's order, sized as the 8k-speed
formats store them (q5 attention/GDN, q4 MLP, q8 head), in CUDA graphs:
- `launches, a program per tile`: a launch per matrix, a program per 8 KB tile (the engine's structure);
- `launches, persistent grid`: a launch per matrix, a grid of SMs x `--per-sm` programs striding over it;
- `... + small launches`: `--small` one-program launches after each matrix (a norm's, an activation's, a split-K
  sum's worth of work: ~450 such launches against 257 matmuls in the real step);
- `one kernel, no barriers`: every matrix in one launch, programs free to run ahead (one kernel's floor);
- `one kernel, barriers`: a grid barrier before each matrix (each matmul waits on the one before);
- `..., early`: each program loads its first tile of the next matrix before it waits (weights never wait on
  activations);
- `..., small phases`: `--small` barrier-separated small phases after each matrix, the small launches' work
  done in place.
Each is checked (the sums of what its programs read against torch's sum of the weights) and timed (graph
replays); the floor is the bytes at the measured copy bandwidth, in the same run.

Usage: python scripts/experiments/persistent_read.py [--per-sm 1 2] [--block 4096] [--small 2]
  -> table + scripts/results/persistent_read_<gpu>.json
"""
from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
sys.path[:0] = [str(ROOT), str(HERE.parent)]  # the engine, and the benchmarks' helpers in scripts/

from bench_spec import FORMATS  # noqa: E402
from bench_util import copy_bandwidth, gpu_name, time_graph_ms, write_results  # noqa: E402
from persistent_read_kernels import phases_kernel, small_kernel  # noqa: E402
from stream_read import read_kernel  # noqa: E402

from engine.models.presets import QWEN36_27B  # noqa: E402
from engine.models.qwen3_5 import Qwen35Model  # noqa: E402
from engine.models.spec import spec_from_hf_config  # noqa: E402
from engine.quant.formats import tensor_bytes  # noqa: E402

TILE = 2048  # words per program of the program-per-tile launches (8 KB)
SMALL_WORDS = 5120  # a small phase's reads: about a norm's (the hidden row and its weight, bf16)
SMALL_BLOCK = 1024


# the step's matmuls in launch order, each a fused group of checkpoint tensors (suffixes under layers.N.), and the
# format class that stores it
MATMULS = {"full_attention": [(("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), "attn"),
                              (("self_attn.o_proj",), "attn")],
           "linear_attention": [(("linear_attn.in_proj_qkv", "linear_attn.in_proj_z", "linear_attn.in_proj_b",
                                  "linear_attn.in_proj_a"), "gdn"), (("linear_attn.out_proj",), "gdn")]}
MLP = [(("mlp.gate_proj", "mlp.up_proj"), "mlp"), (("mlp.down_proj",), "mlp")]


def step_matrices(config: dict) -> list[tuple[str, int]]:
    """(name, bytes) of the T=1 step's matmul weights in launch order, in the 8k-speed formats (`bench_spec`'s)."""
    spec = spec_from_hf_config(config)
    shapes = Qwen35Model.weight_shapes(spec)
    formats = FORMATS.as_dict()

    def nbytes(names: tuple[str, ...], cls: str) -> int:
        return sum(tensor_bytes(math.prod(shapes[n + ".weight"]), formats[cls], 2) for n in names)

    out = []
    for i, kind in enumerate(spec.kinds()):
        out += [(names[0].split(".")[-1], nbytes(tuple(f"layers.{i}.{n}" for n in names), cls))
                for names, cls in MATMULS[kind] + MLP]
    out.append(("lm_head", nbytes(("lm_head",), "lm_head")))
    return [(name, b // 64 * 64) for name, b in out]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--per-sm", type=int, nargs="+", default=[1, 2], help="persistent programs per SM")
    p.add_argument("--block", type=int, default=4096, help="words per persistent program's tile")
    p.add_argument("--small", type=int, default=2, help="small launches / phases after each matrix")
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--only", nargs="+", default=None, help="variant names to run (all by default)")
    args = p.parse_args()
    matrices = step_matrices(QWEN36_27B)
    words = [b // 4 for _, b in matrices]
    total_bytes = 4 * sum(words)
    src = torch.randint(-2**31, 2**31 - 1, (sum(words),), dtype=torch.int32, device="cuda")
    host_starts = [sum(words[:i]) for i in range(len(words))]
    starts = torch.tensor(host_starts, dtype=torch.int64, device="cuda")
    lens = torch.tensor(words, dtype=torch.int64, device="cuda")
    small = torch.randint(-2**31, 2**31 - 1, (SMALL_WORDS,), dtype=torch.int32, device="cuda")
    want_src, want_small = int(src.sum(dtype=torch.int64)), int(small.sum(dtype=torch.int64))
    counter = torch.zeros(2, dtype=torch.int32, device="cuda")  # the barriers' arrivals, a gave-up flag
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    phases = len(words)
    bandwidth = copy_bandwidth()
    floor_ms = total_bytes / bandwidth * 1e3
    print(f"{phases} matrices, {total_bytes / 1e9:.2f} GB, floor {floor_ms:.3f} ms at {bandwidth / 1e9:.0f} GB/s")

    def tiles(small_launches: int):
        outs = [torch.empty(-(-n // TILE), dtype=torch.int32, device="cuda") for n in words]
        small_out = torch.empty(SMALL_BLOCK, dtype=torch.int32, device="cuda")

        def run():
            for p_, n in enumerate(words):
                read_kernel[(outs[p_].numel(),)](src[host_starts[p_]:], outs[p_], n, BLOCK=TILE, num_warps=4)
                for _ in range(small_launches):
                    small_kernel[(1,)](small, small_out, SMALL_WORDS, SMALL_BLOCK=SMALL_BLOCK, num_warps=4)
        return run, lambda: sum(int(o.sum(dtype=torch.int64)) for o in outs), 0

    def persistent(per_sm: int, one_kernel: bool, barrier: bool, early: bool, small_n: int, small_launches: int):
        progs = sms * per_sm
        out = torch.empty(progs * args.block, dtype=torch.int32, device="cuda")
        outs = [torch.empty_like(out) for _ in range(phases)] if not one_kernel else [out]
        small_out = torch.empty(SMALL_BLOCK, dtype=torch.int32, device="cuda")
        shape = dict(BLOCK=args.block, BARRIER=barrier, EARLY=early, SMALL=small_n, SMALL_BLOCK=SMALL_BLOCK,
                     num_warps=8)

        def run():
            if one_kernel:
                counter[0].zero_()
                phases_kernel[(progs,)](src, starts, lens, small, out, counter, 0, phases, SMALL_WORDS, **shape)
                return
            for p_ in range(phases):
                phases_kernel[(progs,)](src, starts, lens, small, outs[p_], counter, p_, p_ + 1, SMALL_WORDS, **shape)
                for _ in range(small_launches):
                    small_kernel[(1,)](small, small_out, SMALL_WORDS, SMALL_BLOCK=SMALL_BLOCK, num_warps=4)
        extra = progs * small_n * phases  # every program adds the small buffer's sum once per small phase
        return run, lambda: sum(int(o.sum(dtype=torch.int64)) for o in outs), extra

    variants = [("launches, a program per tile", 0, tiles(0)),
                ("launches, a program per tile + small launches", 0, tiles(args.small))]
    for per_sm in args.per_sm:
        variants += [
            ("launches, persistent grid", per_sm, persistent(per_sm, False, False, False, 0, 0)),
            ("launches, persistent grid + small launches", per_sm, persistent(per_sm, False, False, False, 0,
                                                                              args.small)),
            ("one kernel, no barriers", per_sm, persistent(per_sm, True, False, False, 0, 0)),
            ("one kernel, barriers", per_sm, persistent(per_sm, True, True, False, 0, 0)),
            ("one kernel, barriers, early", per_sm, persistent(per_sm, True, True, True, 0, 0)),
            ("one kernel, barriers, early, small phases", per_sm, persistent(per_sm, True, True, True, args.small,
                                                                              0))]
    rows = []
    for name, per_sm, (run, got, extra) in variants:
        if args.only and name not in args.only:
            continue
        run()
        torch.cuda.synchronize()
        if counter[1]:  # a barrier gave up: the grid was not resident at once
            print(f"{name:<48} {per_sm:>3} void: not every program fit on the SMs at once", flush=True)
            counter.zero_()
            continue
        ok = (got() - want_src - extra * want_small) % 2**32 == 0
        ms = time_graph_ms(run, calls=1, reps=args.reps)
        rows.append({"gpu": gpu_name(), "variant": name, "programs_per_sm": per_sm, "block_words": args.block,
                     "small": args.small if "small" in name else 0, "matrices": phases, "bytes": total_bytes,
                     "ms": ms, "floor_ms": floor_ms, "ratio_to_floor": ms / floor_ms, "sums_match": ok})
        print(f"{name:<48} {per_sm:>3} {ms:>8.3f} ms {ms / floor_ms:>6.3f}x {'ok' if ok else 'WRONG'}", flush=True)
    print("wrote", write_results("persistent_read", rows))


if __name__ == "__main__":
    main()
