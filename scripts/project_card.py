"""A MODEL, not a measurement: ninfer's one-token step and speculative rounds projected onto a card nobody here can
run (the RTX 4090: sm_89, no programmatic dependent launch), from a kernel profile measured on one we can.

Input: `profile_round.py --kernels` rows (scripts/results/profile_round_<gpu>.json): each kernel's device time and
launches per round, CUDA graphs replayed as the engine runs them, beside the round's device-timeline time
(`round_ms`) from the same run; the card's copy rate is the median of the `bench_decode.py` copy rates measured on
it. The profiles run `synthetic:qwen3.6-27b` in the 8k-speed profile's formats at an 8K context.

Each kernel falls in a class whose bytes (and multiply-adds) per round follow from the model's shapes
(`engine/models/presets.py`, `engine/memory_plan.py`; `round_bytes` below says how). On a card X a class's
roofline is r_X = max(bytes / bw_X, flops / rate_X). Calibrated on card A:
  e_A    = r_A / t_A of the one-token step's matmuls: the share of the copy rate the weight stream reaches on A
  e      = max(e_A, r_A / t_A) per class: the class streams at least as well as the weights do
  L      = t_A - r_A / e: the class's time its bytes do not explain (launch ramp-up, dependent chains), kept as is
  t_B    = L + r_B / e
  round_B = sum of t_B + (round_ms_A - sum of t_A) + launches x pdl_gap
where round_ms_A - sum of t_A is A's gaps between kernels and its host sync (carried over: the same graphs launch
the same kernels), and pdl_gap is what a launch costs more without PDL (the H100's NINFER_PDL=0 step minus its
PDL step, per launch of the step), added only where A launched with PDL and B cannot. Projected onto A itself the
model gives A's measurement exactly; the H200 -> H100 check says how far it is off across cards (both profiles
are of a code version, not necessarily the same one: the check's error holds that difference too).

Usage: python scripts/project_card.py -> table + scripts/results/project_card.json (or $OUT/)
"""
from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
from dataclasses import dataclass, field, replace
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from engine.config import EngineConfig  # noqa: E402
from engine.loaders.synthetic import preset_spec  # noqa: E402
from engine.memory_plan import kv_bytes_per_token, recurrent_state_bytes, weight_bytes  # noqa: E402
from engine.models import weight_shapes  # noqa: E402
from engine.models.dflash import dflash_shapes, dflash_spec  # noqa: E402
from engine.models.presets import DFLASH_QWEN36_27B  # noqa: E402
from engine.models.qwen3_5 import mtp_shapes  # noqa: E402
from engine.quant.formats import tensor_bytes  # noqa: E402
from ninfer_tui import profiles, speed_reference  # noqa: E402

RESULTS = ROOT / "scripts" / "results"
PRESET = "qwen3.6-27b"
PROFILE = "8k-speed"
CONTEXT = 8192  # what profile_round.py runs at
DTYPE_BYTES = 2  # bf16 activations and unquantized tensors on a GPU
# kernel name -> class; first match wins. The pieces' profiler ranges (`profile_round.py` records them beside the
# kernels) are no kernels and are left out.
CLASSES = (("matmul", r"qtiled|kernel_rows|kernel_mma|qmatmul|gemm|gemv|nvjet|cutlass|splitKreduce"),
           ("attention", r"attention_kernel|combine_kernel"), ("gdn", r"gdn"))
PIECES = {"step", "verify", "propose", "observe", "commit", "accept", "pick"}


@dataclass(frozen=True)
class Card:
    name: str
    bw: float  # bytes/s: a measured device-to-device copy rate (read + write counted)
    int8_ops: float  # dense INT8 tensor-core ops/s
    bf16_flops: float  # dense BF16 tensor-core flop/s (FP32 accumulate)
    pdl: bool  # programmatic dependent launch (sm_90+)
    source: str


# Compute rates are the vendors' dense figures; the H100/H200 copy rates are read from our runs (`measured_card`).
RATES = {"NVIDIA H100 80GB HBM3": (1979e12, 989e12, True, "NVIDIA H100 SXM datasheet (dense)"),
         "NVIDIA H200": (1979e12, 989e12, True, "NVIDIA H200 datasheet (dense)")}
RTX_4090 = Card("RTX 4090", 921e9, 660e12, 165e12, False,
                "../shared/research/peers.md: 918-924 GB/s measured copy (921 taken), INT8 660 TOPS and BF16 165 "
                "TFLOPS dense, sm_89 without PDL")


@dataclass(frozen=True)
class Calibration:
    """Which measured rows a projection starts from: one run of profile_round.py --kernels on one card."""
    gpu: str
    run: str  # the rows' `run` label starts with this
    pdl: bool  # whether that run's kernels launched with PDL: a card without PDL pays a gap per launch more


CALIBRATIONS = (Calibration("NVIDIA H200", "2026-12-04 (16d)", pdl=False),
                Calibration("NVIDIA H100 80GB HBM3", "(20) ", pdl=False))
CHECK = ("NVIDIA H200", "NVIDIA H100 80GB HBM3")  # project the first onto the second, compare with its measurement


@dataclass
class ClassTime:
    us: float = 0.0
    launches: float = 0.0


@dataclass
class Round:
    """One measured round: its cases' kernel classes (device us and launches per round) and its time."""
    gpu: str
    spec: str
    k: int
    round_ms: float
    run: str
    classes: dict[str, ClassTime] = field(default_factory=dict)

    @property
    def kernel_us(self) -> float:
        return sum(c.us for c in self.classes.values())

    @property
    def launches(self) -> float:
        return sum(c.launches for c in self.classes.values())


@dataclass(frozen=True)
class Work:
    """What a class moves and computes per round."""
    bytes: float
    flops: float = 0.0
    bf16: bool = False  # its flops run at the BF16 rate (else INT8)


def class_of(name: str) -> str:
    return next((c for c, pat in CLASSES if re.search(pat, name)), "small")


def load_rounds(cal: Calibration, results: Path = RESULTS) -> list[Round]:
    """The greedy rounds of one profile_round.py --kernels run, classes summed."""
    path = results / f"profile_round_{cal.gpu.replace(' ', '_')}.json"
    out = []
    for row in json.loads(path.read_text()):
        if not row["run"].startswith(cal.run) or "kernels" not in row or row.get("temperature", 0.0) != 0.0:
            continue
        r = Round(row["gpu"], row["spec"], row["K"], row["round_ms"], row["run"])
        for kern in row["kernels"]:
            if kern["name"] in PIECES:
                continue
            c = r.classes.setdefault(class_of(kern["name"]), ClassTime())
            c.us += kern["us"]
            c.launches += kern["launches"]
        out.append(r)
    if not out:
        sys.exit(f"no greedy rows of run {cal.run!r} with kernels in {path}: run profile_round.py --kernels")
    return out


def measured_card(gpu: str, results: Path = RESULTS) -> Card:
    """A card we run: its copy rate the median of those bench_decode.py measured on it."""
    path = results / f"bench_decode_{gpu.replace(' ', '_')}.json"
    rates = [r["copy_bw_gbs"] for r in json.loads(path.read_text()) if r.get("phase") == "bandwidth"]
    int8, bf16, pdl, rates_source = RATES[gpu]
    return Card(gpu, statistics.median(rates) * 1e9, int8, bf16, pdl,
                f"copy rate: median of {len(rates)} runs in {path.name}; {rates_source}")


def _params(shapes: dict) -> int:
    return sum(s[0] * s[1] for s in shapes.values() if len(s) == 2)


def round_bytes(spec_name: str, k: int) -> dict[str, Work]:
    """Bytes and multiply-adds per round of each class, 8K context, 8k-speed formats (int8 KV):
    - matmul: the target's weights once per forward (the embedding table excepted, of which a few rows are read),
      the T = K+1 rows multiplied by them; DFlash adds its drafter's projections (q8) and the target's LM head for
      the drafts (propose) and its fc + K/V projections over the accepted tokens (observe); MTP runs its layer and
      the LM head once per draft after the first and once to observe (K times).
    - attention: the target's KV at the context (one read per forward); DFlash its context K/V (bf16, each layer's
      window), MTP its one layer's KV at the context for each of its K steps; QK and PV at the BF16 rate.
    - gdn: the recurrent state (fp32) read and written by a T=1 step; a verify step reads it, the commit replays
      the accepted tokens into it (read + write).
    - small (norms, SiLU, conv, KV writes, copies, sampling): the rows they read and write, T rows of `hidden`
      bf16 in and out per launch, and the conv window read and written; bytes that barely matter (these kernels
      wait on latency), stated so the formula is complete."""
    geometry = preset_spec(PRESET)
    profile = profiles.load(PROFILE)
    config = EngineConfig(f"synthetic:{PRESET}", weights=profile.weights, kv_dtype=profile.kv_dtype)
    formats = profile.weights.as_dict()
    t = k + 1
    embed = tensor_bytes(geometry.vocab_size * geometry.hidden_size, formats["embed"], DTYPE_BYTES)
    head = tensor_bytes(geometry.vocab_size * geometry.hidden_size, formats["lm_head"], DTYPE_BYTES)
    head_params = geometry.vocab_size * geometry.hidden_size
    target = weight_bytes(geometry, config, DTYPE_BYTES) - embed
    target_params = _params(weight_shapes(geometry)) - head_params  # the embedding table multiplies nothing
    attn_layers = sum(1 for kind in geometry.kinds() if kind == "full_attention")
    kv = CONTEXT * kv_bytes_per_token(geometry, profile.kv_dtype, DTYPE_BYTES)
    attn_flops = 4 * t * CONTEXT * geometry.num_heads * geometry.head_dim * attn_layers
    conv, rec = recurrent_state_bytes(geometry, DTYPE_BYTES)
    matmul, matmul_flops = target, 2 * t * target_params
    if spec_name == "dflash":
        d = dflash_spec(DFLASH_QWEN36_27B)
        shapes = dflash_shapes(d)
        drafter = sum(tensor_bytes(s[0] * s[1], config.drafter_weights, DTYPE_BYTES) for s in shapes.values()
                      if len(s) == 2)
        observed = {n: s for n, s in shapes.items() if n == "fc.weight" or re.search(r"[kv]_proj", n)}
        observe = sum(tensor_bytes(s[0] * s[1], config.drafter_weights, DTYPE_BYTES) for s in observed.values())
        block = max(d.block_size, t)
        matmul += drafter + head + observe
        matmul_flops += 2 * (block * _params(shapes) + k * head_params + t * _params(observed))
        window_tokens = sum(min(CONTEXT, w or CONTEXT) for w in d.window)
        kv += window_tokens * 2 * d.num_kv_heads * d.head_dim * DTYPE_BYTES
        attn_flops += 4 * block * window_tokens * d.num_heads * d.head_dim
    elif spec_name == "mtp":
        shapes = mtp_shapes(geometry)
        mtp = weight_bytes(geometry, config, DTYPE_BYTES, shapes)
        matmul += k * (mtp + head)
        matmul_flops += 2 * k * (_params(shapes) + head_params)
        kv += k * CONTEXT * kv_bytes_per_token(geometry, profile.kv_dtype, DTYPE_BYTES, layers=geometry.mtp_layers)
        attn_flops += 4 * k * CONTEXT * geometry.num_heads * geometry.head_dim
    gdn = 2 * rec if spec_name == "none" else 3 * rec
    small = 2 * conv  # + the rows, per launch: added in `project`, which knows the launches
    return {"matmul": Work(matmul, matmul_flops), "attention": Work(kv, attn_flops, bf16=True), "gdn": Work(gdn),
            "small": Work(small)}


def work_of(r: Round) -> dict[str, Work]:
    work = round_bytes(r.spec, r.k)
    rows = (r.k + 1) * preset_spec(PRESET).hidden_size * DTYPE_BYTES
    small = r.classes.get("small", ClassTime())
    work["small"] = replace(work["small"], bytes=work["small"].bytes + small.launches * 2 * rows)
    return work


def roofline_us(w: Work, card: Card) -> float:
    return 1e6 * max(w.bytes / card.bw, w.flops / (card.bf16_flops if w.bf16 else card.int8_ops))


@dataclass(frozen=True)
class Projection:
    spec: str
    k: int
    round_ms: float
    kernel_ms: float
    overhead_ms: float
    classes_us: dict[str, float]


def stream_efficiency(step: Round, card: Card) -> float:
    """The share of A's copy rate its weight stream reaches: the one-token step's matmuls' roofline over their
    measured time."""
    return roofline_us(work_of(step)["matmul"], card) / step.classes["matmul"].us


def pdl_gap_us(step: Round, results: Path = RESULTS) -> float:
    """What a launch costs more without PDL: the H100's T=1 step with NINFER_PDL=0 minus with PDL (ab_step.py,
    same process), over the launches of `step`."""
    rows = json.loads((results / "ab_step_pdl_NVIDIA_H100_80GB_HBM3.json").read_text())["summary"]
    ms = {r["variant"]: r["median_ms"] for r in rows if r["T"] == 1}
    return 1e3 * (ms["no PDL"] - ms["engine"]) / step.launches


def project(r: Round, step: Round, a: Card, b: Card, pdl: bool, results: Path = RESULTS) -> Projection:
    """Round `r` measured on card A (calibrated by A's one-token `step`) as card B would run it."""
    e_a = stream_efficiency(step, a)
    work = work_of(r)
    classes = {}
    for name, c in r.classes.items():
        ra, rb = roofline_us(work[name], a), roofline_us(work[name], b)
        e = max(e_a, ra / c.us) if c.us > 0 else e_a
        classes[name] = (c.us - ra / e) + rb / e
    overhead_us = 1e3 * r.round_ms - r.kernel_us
    if pdl and not b.pdl:
        overhead_us += r.launches * pdl_gap_us(step, results)
    kernel_us = sum(classes.values())
    return Projection(r.spec, r.k, (kernel_us + overhead_us) / 1e3, kernel_us / 1e3, overhead_us / 1e3, classes)


def rows_for(cal: Calibration, target: Card, results: Path = RESULTS) -> list[dict]:
    rounds = load_rounds(cal, results)
    step = next(r for r in rounds if r.spec == "none")
    a = measured_card(cal.gpu, results)
    out = []
    for r in rounds:
        p = project(r, step, a, target, cal.pdl, results)
        tokens = speed_reference.reference_tokens(r.spec, r.k)
        out.append({"gpu": f"{target.name} (projected)", "projected": True, "calibrated_on": cal.gpu,
                    "calibration_run": r.run, "calibration_file": f"profile_round_{cal.gpu.replace(' ', '_')}.json",
                    "spec": r.spec, "K": r.k, "tokens_per_round": tokens, "round_ms": p.round_ms,
                    "tok_s": tokens * 1e3 / p.round_ms, "step_ms": None, "kernel_ms": p.kernel_ms,
                    "overhead_ms": p.overhead_ms, "classes_us": p.classes_us,
                    "calibration_round_ms": r.round_ms, "calibration_tok_s": tokens * 1e3 / r.round_ms,
                    "stream_efficiency": stream_efficiency(step, a), "card_bw_gbs": target.bw / 1e9,
                    "calibration_bw_gbs": a.bw / 1e9, "card_source": target.source, "calibration_source": a.source,
                    "model": "projection: per kernel class max(bytes / bw, flops / rate) at the calibration card's "
                             "stream efficiency + the class's unexplained time + the calibration's gaps"})
    step_ms = next(x["round_ms"] for x in out if x["spec"] == "none")
    for x in out:
        x["step_ms"] = step_ms
    return out


def check_rows(results: Path = RESULTS) -> list[dict]:
    """The model across cards: the first card of CHECK projected onto the second, beside its measurement."""
    source, dest = (next(c for c in CALIBRATIONS if c.gpu == g) for g in CHECK)
    measured = {(r.spec, r.k): r for r in load_rounds(dest, results)}
    out = []
    for row in rows_for(source, measured_card(dest.gpu, results), results):
        m = measured.get((row["spec"], row["K"]))
        if m is None:
            continue
        row.update({"check": True, "measured_round_ms": m.round_ms, "measured_run": m.run,
                    "error": row["round_ms"] / m.round_ms - 1})
        out.append(row)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.parse_args()
    rows = [row for cal in CALIBRATIONS for row in rows_for(cal, RTX_4090)] + check_rows()
    print("A MODEL'S PROJECTION, not a measurement (scripts/project_card.py's docstring says how).")
    print(f"{'card':28s} {'calibrated on':22s} {'spec':7s} {'K':>2s} {'tok/round':>9s} {'round ms':>9s} "
          f"{'tok/s':>7s}   beside: calibration round ms, tok/s (or the check's measured round, error)")
    for r in rows:
        tail = (f"measured {r['measured_round_ms']:.2f} ms ({r['measured_run'][:20]}), error {100 * r['error']:+.1f}%"
                if r.get("check") else f"{r['calibration_round_ms']:.2f} ms, {r['calibration_tok_s']:.1f} tok/s")
        print(f"{r['gpu']:28s} {r['calibrated_on'][:22]:22s} {r['spec']:7s} {r['K']:2d} {r['tokens_per_round']:9.2f} "
              f"{r['round_ms']:9.2f} {r['tok_s']:7.1f}   {tail}")
    out = Path(os.environ.get("OUT") or RESULTS)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "project_card.json"
    path.write_text(json.dumps(rows, indent=2))
    print("wrote", path)


if __name__ == "__main__":
    main()
