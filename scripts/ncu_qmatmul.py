"""Hardware counters of the quantized matmuls on the 27B shapes, one launch each of the chosen kernel at 1 and 8
rows and of a kernel that only reads the same bytes, under Nsight Compute: what each one waits on (DRAM
throughput, issue slots, warp stall reasons). Its numbers say where a kernel's time goes; speed itself is
measured by bench_qmatmul.py.

Usage (on the GPU machine; ncu flushes the caches before every measured pass):
  python scripts/ncu_qmatmul.py --plan manifest.json   (chooses the kernels by timing them, outside ncu)
  ncu --clock-control none --profile-from-start off --section SpeedOfLight --section WarpStateStats \
      --section SchedulerStats --section LaunchStats --section Occupancy --page raw --csv \
      --log-file report.csv python scripts/ncu_qmatmul.py manifest.json
  python scripts/ncu_qmatmul.py --summarize report.csv manifest.json   -> table + bench_ncu_qmatmul_<gpu>.json
"""
from __future__ import annotations

import argparse
import csv
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

# metric (ncu raw name) -> column of the summary
METRICS = {
    "gpu__time_duration.sum": "us",
    "gpu__dram_throughput.avg.pct_of_peak_sustained_elapsed": "dram_pct",
    "sm__throughput.avg.pct_of_peak_sustained_elapsed": "sm_pct",
    "smsp__issue_active.avg.pct_of_peak_sustained_active": "issue_pct",
    "sm__warps_active.avg.pct_of_peak_sustained_active": "occupancy_pct",
    "launch__registers_per_thread": "regs",
    "smsp__average_warp_latency_per_inst_issued.ratio": "cycles_per_issue",
}
STALL = "smsp__average_warps_issue_stalled_"  # + reason + "_per_issue_active.ratio": warps stalled per issue


def profile(manifest: Path, plan: bool) -> None:
    """With `plan`, choose each shape's kernels (timed, so not under ncu, whose interception skews the timing) and
    write them to the manifest; else launch what the manifest names, once each, inside the profiled range."""
    from dataclasses import asdict

    import torch
    from bench_qmatmul import SHAPES
    from bench_util import read_rows

    from engine.kernels.actquant import QuantRows, quantize_rows
    from engine.kernels.qmatmul import QConfig, choose, launch, split_rows
    from engine.quant.qweight import quantize

    g = torch.Generator(device="cuda").manual_seed(0)
    wanted = [] if plan else json.loads(manifest.read_text())
    calls, names = [], []
    for name, n, k, fmt in SHAPES:
        if name == "lm head":  # 311 us, streams at the copy rate already
            continue
        w = quantize(torch.randn(n, k, device="cuda", dtype=torch.bfloat16, generator=g) * k ** -0.5, fmt)
        meta = {"shape": name, "N": n, "K": k, "weights": fmt}
        for rows in (1, 8):
            x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16, generator=g)
            if plan:
                cfg = choose(rows, x.dtype, x.device, w)
                names.append(dict(meta, T=rows, kernel=asdict(cfg), chosen=True))
                continue
            for entry in (e for e in wanted if e["shape"] == name and e["T"] == rows):
                cfg = QConfig(**entry["kernel"])
                pre = QuantRows(x, *quantize_rows(x, split_rows(w))) if cfg.int8_rows else None
                calls.append(lambda x=x, w=w, cfg=cfg, pre=pre: launch(x, w, cfg, pre=pre, partial=True))
        buf = torch.randint(-2**31, 2**31 - 1, (w.nbytes // 4,), dtype=torch.int32, device="cuda", generator=g)
        if plan:
            names.append(dict(meta, T=0, kernel="read-only stream", chosen=None))
        else:
            calls.append(lambda buf=buf: read_rows(buf))
    if plan:
        manifest.write_text(json.dumps(names))
        return
    for c in calls:  # compile and warm outside the profiled range
        c()
    torch.cuda.synchronize()
    torch.cuda.profiler.start()
    for c in calls:
        c()
    torch.cuda.synchronize()
    torch.cuda.profiler.stop()


def summarize(report: Path, manifest: Path) -> None:
    from bench_util import write_results

    names = json.loads(manifest.read_text())
    lines = report.read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith('"ID"'))
    table = list(csv.DictReader(lines[start:]))
    kernels = [r for r in table[1:] if r.get("ID", "").isdigit()]  # row 0 holds the units
    if len(kernels) != len(names):
        sys.exit(f"{len(kernels)} profiled kernels for {len(names)} launches: the manifest does not match")
    rows = []
    for meta, r in zip(names, kernels, strict=True):
        row = dict(meta, gpu=r.get("Device Name"))
        for metric, col in METRICS.items():
            value = r.get(metric)
            row[col] = float(value.replace(",", "")) if value not in (None, "", "n/a") else None
        if row["us"] is not None:
            row["us"] /= 1e3  # ncu reports ns
        stalls = {m[len(STALL):].removesuffix("_per_issue_active.ratio"): float(v.replace(",", ""))
                  for m, v in r.items() if m.startswith(STALL) and m.endswith("_per_issue_active.ratio")
                  and v not in ("", "n/a")}
        row["stalls_per_issue"] = dict(sorted(stalls.items(), key=lambda kv: -kv[1])[:5])
        rows.append(row)
        top = ", ".join(f"{k} {v:.2f}" for k, v in row["stalls_per_issue"].items())
        print(f"{meta['shape']:24s} T={meta['T']} {row['us'] or 0:7.1f} us dram {row['dram_pct'] or 0:5.1f}% "
              f"issue {row['issue_pct'] or 0:5.1f}% occ {row['occupancy_pct'] or 0:5.1f}% regs {row['regs']} | {top}"
              f" | {meta['kernel']}")
    write_results("bench_ncu_qmatmul", rows)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--plan", action="store_true", help="choose the kernels and write the manifest (without ncu)")
    p.add_argument("--summarize", type=Path, help="the ncu raw CSV report to read")
    p.add_argument("manifest", type=Path)
    args = p.parse_args()
    if args.summarize:
        summarize(args.summarize, args.manifest)
    else:
        profile(args.manifest, args.plan)


if __name__ == "__main__":
    main()
