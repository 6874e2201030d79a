"""Writes ninfer's own rows of the speed check's reference table (`ninfer_tui/speed_references.json`) from
scripts/results, each naming its file and run:
- "measured": per GPU we run, the plain step and the MTP K=3 and DFlash K=7 rounds of one `bench_spec.py` run
  (8k-speed formats and layout, int8 KV, 8K context, greedy), each round's measured time at the reference run's
  tokens a round (the other engine's acceptance: 1 + K x acceptance). Random weights keep no drafts, so the round
  time is measured and the acceptance is the reference's; `ninfer generate --set draft_acceptance=...` would
  measure both at once, and no such run is in scripts/results yet.
- "projected": the RTX 4090 rows of `scripts/project_card.py` (scripts/results/project_card.json): a model's
  projection, labelled so everywhere it appears.
- the CPU's: ninfer's median decode speed in the `bench_cpu.py` run (scripts/results/bench_cpu.json), llama.cpp's
  on the same file in the same run named beside it.
The other rows (the other engine's) are kept as they are.

Usage: python scripts/speed_reference_rows.py [--check] (--check: exit 1 if the file is not what it would write)
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from ninfer_tui import speed_reference  # noqa: E402

RESULTS = ROOT / "scripts" / "results"
PROFILE = "8k-speed"
# GPU name as the results name it -> (the substring a user's GPU name is matched by, the bench_spec.py run taken)
RUNS = {"NVIDIA H200": ("H200", "2026-12-05 (23)"), "NVIDIA H100 80GB HBM3": ("H100 80GB HBM3", "(22) ")}
CASES = (("none", 0), ("mtp", 3), ("dflash", 7))
PROJECTED_ON = "NVIDIA H100 80GB HBM3"  # the calibration nearest the RTX 4090's bandwidth: the shortest extrapolation
CPU_TASK_TOKENS = 256  # the speed check's run on the CPU: short, as a CPU decodes a few dozen tokens a second


def setup(spec: str, k: int) -> dict:
    return {"kv_dtype": "int8", "spec": spec, **({"draft_tokens": k} if k else {}), "cuda_graphs": True,
            "max_context": 8192}


def measured_rows(results: Path = RESULTS) -> list[dict]:
    out = []
    for gpu, (match, run) in RUNS.items():
        name = f"bench_spec_{gpu.replace(' ', '_')}.json"
        rows = [r for r in json.loads((results / name).read_text()) if r["run"].startswith(run)
                and r.get("temperature", 0.0) == 0.0 and r.get("layout", "auto") == "auto"]
        for spec, k in CASES:
            row = next(r for r in rows if r["spec"] == spec and r["K"] == k)
            tokens = speed_reference.reference_tokens(spec, k)
            at = f", at the reference's {tokens:.2f} tokens a round" if k else ""
            out.append({"gpu": match, "profile": PROFILE, "spec": spec, "decode_tok_s": tokens * 1e3 / row["round_ms"],
                        "source": f"ninfer, measured: {row['round_ms']:.2f} ms a round ({name}, run "
                                  f"{row['run'][:40]!r}){at}",
                        "setup": setup(spec, k), "kind": "measured", "round_ms": row["round_ms"],
                        "tokens_per_round": tokens, "extra": {"results_file": name, "run": row["run"]}})
    return out


def projected_rows(results: Path = RESULTS) -> list[dict]:
    name = "project_card.json"
    out = []
    for row in json.loads((results / name).read_text()):
        if row.get("check") or row["calibrated_on"] != PROJECTED_ON:
            continue
        tokens = row["tokens_per_round"]
        at = f", at the reference's {tokens:.2f} tokens a round" if row["K"] else ""
        out.append({"gpu": "RTX 4090", "profile": PROFILE, "spec": row["spec"], "decode_tok_s": row["tok_s"],
                    "source": f"ninfer, PROJECTED (a model, not a measurement; scripts/project_card.py): "
                              f"{row['round_ms']:.2f} ms a round from the {row['calibrated_on']} profile "
                              f"({row['calibration_file']}, run {row['calibration_run'][:30]!r}){at}",
                    "setup": setup(row["spec"], row["K"]), "kind": "projected", "round_ms": row["round_ms"],
                    "tokens_per_round": tokens, "extra": {"results_file": name, "run": row["calibration_run"]}})
    return out


def cpu_rows(results: Path = RESULTS) -> list[dict]:
    name = "bench_cpu.json"
    run = json.loads((results / name).read_text())
    ours = run["engines"]["ninfer"]
    theirs = run["engines"].get("llama.cpp")
    beside = (f"; llama.cpp on the same file in the same run: {theirs['decode_tok_s_median']:.1f} tok/s"
              if theirs else "")
    return [{"gpu": "cpu", "profile": "cpu-default", "spec": "none", "decode_tok_s": ours["decode_tok_s_median"],
             "source": f"ninfer, measured: median decode of {len(ours['runs'])} runs of scripts/bench_cpu.py ({name}: "
                       f"{run['gguf']}, {run['prompt_tokens']}-token prompt, {run['new_tokens']} greedy tokens, "
                       f"{run['threads']} threads on {run['cores']} cores){beside}",
             "setup": {"kv_dtype": "auto", "spec": "none", "threads": run["threads"]}, "kind": "measured",
             "new_tokens": CPU_TASK_TOKENS, "extra": {"results_file": name}}]


def table(results: Path = RESULTS, data: Path = speed_reference.DATA) -> dict:
    """The data file as it should be: its hand-entered rows, then the rows derived from `results`."""
    current = json.loads(data.read_text())
    kept = [r for r in current["rows"] if "results_file" not in r.get("extra", {}) and r["gpu"] != "cpu"]
    return {**current, "rows": kept + measured_rows(results) + projected_rows(results) + cpu_rows(results)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--check", action="store_true")
    args = p.parse_args()
    want = json.dumps(table(), indent=2) + "\n"
    if args.check:
        sys.exit(0 if speed_reference.DATA.read_text() == want else 1)
    speed_reference.DATA.write_text(want)
    for r in json.loads(want)["rows"]:
        print(f"{r['gpu']:16s} {r['profile']:12s} {r['spec']:7s} {r['decode_tok_s']:8.1f} tok/s  [{r['kind']}] "
              f"{r['source']}")
    print("wrote", speed_reference.DATA)


if __name__ == "__main__":
    main()
