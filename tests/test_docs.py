"""What a newcomer follows must lead somewhere: every link in the docs (docs/, engine/kernels/NOTES.md,
scripts/experiments/README.md) names a file or a heading that exists, every repository path the docs quote in
backticks exists, and every script in scripts/ that a user or developer runs answers --help."""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = sorted((ROOT / "docs").glob("*.md")) + [ROOT / "engine" / "kernels" / "NOTES.md",
                                               ROOT / "scripts" / "experiments" / "README.md"]
# the dated lab notes quote the paths of their day (removed scripts, older names): only their links are checked
LAB_NOTES = sorted((ROOT / "docs" / "lab-notes").glob("*.md"))
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
QUOTED_PATH = re.compile(r"`((?:engine|ninfer_tui|scripts|profiles|tests|docs)/[A-Za-z0-9_./-]+)`")
HELPERS = {"bench_util.py", "stream_read.py"}  # modules the benchmarks import, not run on their own


def anchors(doc: Path) -> set[str]:
    """GitHub's anchors of a Markdown file's headings."""
    out = set()
    for line in doc.read_text().splitlines():
        if line.startswith("#"):
            title = line.lstrip("#").strip().lower()
            out.add(re.sub(r"\s", "-", re.sub(r"[^\w\s-]", "", title)))
    return out


def broken_links(doc: Path) -> list[str]:
    bad = []
    for target in LINK.findall(doc.read_text()):
        if re.match(r"[a-z]+:", target):  # http(s), mailto: not this test's business
            continue
        path, _, anchor = target.partition("#")
        dest = (doc.parent / path).resolve() if path else doc
        if not dest.exists():
            bad.append(target)
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            bad.append(target)
    return bad


def test_every_doc_exists_and_every_link_leads_somewhere():
    for name in ("architecture", "performance", "kernels", "profiles", "api", "troubleshooting"):
        assert (ROOT / "docs" / f"{name}.md").is_file(), name
    bad = {str(d.relative_to(ROOT)): broken_links(d) for d in DOCS + LAB_NOTES}
    assert not {d: links for d, links in bad.items() if links}


def test_every_quoted_repository_path_exists():
    missing = {}
    for doc in DOCS:
        gone = [p for p in QUOTED_PATH.findall(doc.read_text()) if not (ROOT / p.rstrip("/")).exists()]
        if gone:
            missing[str(doc.relative_to(ROOT))] = gone
    assert not missing


def test_the_link_check_finds_a_broken_link(tmp_path):
    doc = tmp_path / "a.md"
    (tmp_path / "b.md").write_text("# A heading\n")
    doc.write_text("[ok](b.md) [ok](b.md#a-heading) [web](https://example.com) [gone](c.md) [no](b.md#nope)\n")
    assert broken_links(doc) == ["c.md", "b.md#nope"]


HELP = """
import contextlib, io, runpy, sys
sys.path.insert(0, "scripts")
for path in sys.argv[1:]:
    out = io.StringIO()
    sys.argv = [path, "--help"]
    code = None
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        try:
            runpy.run_path(path, run_name="__main__")
        except SystemExit as e:
            code = e.code
    print(path, code in (0, None) and "usage:" in out.getvalue())
"""


@pytest.mark.slow
def test_every_script_answers_help():
    scripts = sorted(p for p in (ROOT / "scripts").glob("*.py") if p.name not in HELPERS)
    run = subprocess.run([sys.executable, "-c", HELP, *map(str, scripts)], cwd=ROOT, capture_output=True,
                         text=True, timeout=600)
    answered = dict(line.rsplit(" ", 1) for line in run.stdout.splitlines())
    assert answered == {str(p): "True" for p in scripts}, run.stderr[-2000:]
    for sh in sorted((ROOT / "scripts").glob("*.sh")):
        out = subprocess.run(["bash", str(sh), "--help"], cwd=ROOT, capture_output=True, text=True, timeout=30)
        assert out.returncode == 0 and "Usage" in out.stdout, sh.name
