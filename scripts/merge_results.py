"""Fold a device run's results file into the committed one: the new rows, each tagged with `--run`, replace every
committed row except those whose run tag starts with one of `--keep` (e.g. bench_decode's bf16, prefill and
transformers rows of an earlier run, which a quick run does not measure again).
Usage: python scripts/merge_results.py NEW.json scripts/results/NAME.json --run "TAG" [--keep TAG...]"""
from __future__ import annotations

import argparse
import json
from pathlib import Path


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("new", type=Path)
    p.add_argument("committed", type=Path)
    p.add_argument("--run", required=True, help="what this run was (date, change, command)")
    p.add_argument("--keep", nargs="*", default=[], help="run tags of older rows to keep beside the new ones")
    args = p.parse_args()
    old = json.loads(args.committed.read_text()) if args.committed.exists() else []
    kept = [r for r in old if any(r.get("run", "").startswith(k) for k in args.keep)]
    new = [{**r, "run": args.run} for r in json.loads(args.new.read_text())]
    args.committed.write_text(json.dumps(new + kept, indent=2))
    print(f"{args.committed}: {len(new)} new rows, {len(kept)} kept")


if __name__ == "__main__":
    main()
