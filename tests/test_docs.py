"""What a newcomer follows must lead somewhere: every link in the docs (docs/, engine/kernels/NOTES.md,
scripts/experiments/README.md) names a file or a heading that exists, every repository path the docs quote in
backticks exists, and every script in scripts/ that a user or developer runs answers --help."""
from __future__ import annotations

import argparse
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from ninfer_tui.cli import build_parser

ROOT = Path(__file__).resolve().parent.parent
DOCS = sorted((ROOT / "docs").glob("*.md")) + [ROOT / "engine" / "kernels" / "NOTES.md",
                                               ROOT / "scripts" / "experiments" / "README.md"]
# the dated lab notes quote the paths of their day (removed scripts, older names): only their links are checked
LAB_NOTES = sorted((ROOT / "docs" / "lab-notes").glob("*.md"))
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"```[a-z]*\n(.*?)```", re.S)
QUOTED_PATH = re.compile(r"`((?:engine|ninfer_tui|scripts|profiles|tests|docs)/[A-Za-z0-9_./-]+)`")
HELPERS = {"bench_util.py", "stream_read.py"}  # modules the benchmarks import, not run on their own


def anchors(doc: Path) -> set[str]:
    """GitHub's anchors of a Markdown file's headings (a `#` comment in a code block is none)."""
    out = set()
    for line in FENCE.sub("", doc.read_text()).splitlines():
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
    missing, quoted = {}, 0
    for doc in DOCS:
        paths = QUOTED_PATH.findall(doc.read_text())
        quoted += len(paths)
        gone = [p for p in paths if not (ROOT / p.rstrip("/")).exists()]
        if gone:
            missing[str(doc.relative_to(ROOT))] = gone
    assert quoted  # the pattern still finds the docs' paths: none found would pass vacuously
    assert not missing


def test_the_link_check_finds_a_broken_link(tmp_path):
    doc = tmp_path / "a.md"
    (tmp_path / "b.md").write_text("# A heading\n```bash\n# in code\n```\n")
    doc.write_text("[ok](b.md) [ok](b.md#a-heading) [web](https://example.com) [gone](c.md) [no](b.md#nope) "
                   "[code](b.md#in-code)\n")
    assert broken_links(doc) == ["c.md", "b.md#nope", "b.md#in-code"]


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


# The newcomer's README: every `ninfer ...` command and `--flag` it shows exists in the CLI, every script command
# names a script that takes those flags, and every file it links or quotes exists. The CLI's parser is inspected
# in-process: building it imports neither torch nor the engine.
README = ROOT / "README.md"
INLINE = re.compile(r"`([^`\n]+)`")
QUICK_START = ('python3 -m venv .venv && . .venv/bin/activate && pip install torch==2.13.0 . && echo "Write a haiku '
               'about GPUs." | ninfer', ". .venv/bin/activate && pip install -e '.[test]' && python -m pytest -q")


def _parsers(parser, path=()):
    yield path, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _parsers(sub, (*path, name))


def _subcommands(parser) -> dict | None:
    return next((a.choices for a in parser._actions if isinstance(a, argparse._SubParsersAction)), None)


def cli_problems(tokens: list[str]) -> list[str]:
    """What in `ninfer TOKENS` the CLI does not have: a command, a flag, or a value outside a flag's or an
    argument's choices. `a|b` stands for alternatives; words in capitals for placeholders."""
    parser, path, i = build_parser(), ["ninfer"], 0
    while (subs := _subcommands(parser)) is not None and i < len(tokens) and not tokens[i].startswith("-"):
        names = tokens[i].split("|")
        if unknown := [n for n in names if n not in subs]:
            return [f"{' '.join(path)}: no command {unknown}"]
        if len(names) > 1:
            return []
        parser, i = subs[names[0]], i + 1
        path.append(names[0])
    options = {s: a for a in parser._actions for s in a.option_strings}
    positionals = [a for a in parser._actions if not a.option_strings and not isinstance(a, argparse._SubParsersAction)]
    problems, given = [], []
    while i < len(tokens):
        tok = tokens[i]
        if tok == "--":  # the rest belongs to a launched client
            break
        if tok.startswith("-") and len(tok) > 1:
            flag, eq, value = tok.partition("=")
            action = options.get(flag)
            if action is None:
                problems.append(f"{' '.join(path)}: no flag {flag}")
            elif action.nargs != 0 and not eq and i + 1 < len(tokens):
                i += 1
                value = tokens[i]
            if action is not None and action.choices and value and not value.isupper():
                problems += [f"{' '.join(path)} {flag}: no choice {v}" for v in value.split("|")
                             if v not in action.choices]
        else:
            given.append(tok)
        i += 1
    if given and positionals and positionals[0].choices and not given[0].isupper():
        problems += [f"{' '.join(path)}: no choice {v}" for v in given[0].split("|") if v not in positionals[0].choices]
    return problems


def readme_commands(text: str) -> list[list[str]]:
    """The README's shell commands, code blocks (comments dropped, continuation lines joined, `&&`/`|`/`;`
    chains split) and inline code alike, each as its words."""
    blocks = [re.sub(r"\s#.*", "", line) for b in FENCE.findall(text) for line in b.replace("\\\n", " ").splitlines()]
    inline = [span for span in INLINE.findall(FENCE.sub("", text)) if span.startswith(("ninfer", "python", "bash"))]
    commands = []
    for line in blocks + inline:
        try:
            words = shlex.split(line)
        except ValueError:  # an unbalanced quote in prose-like code: not a command
            continue
        command: list[str] = []
        for word in [*words, "&&"]:
            if word in ("&&", "|", ";", "||"):
                if command:
                    commands.append(command)
                command = []
            else:
                command.append(word)
    return commands


def readme_flag_spans(text: str) -> list[str]:
    """Inline code that shows a flag on its own (`--threads 4`, `--weights q8|q5|q4`, `-P`)."""
    return [span for span in INLINE.findall(FENCE.sub("", text)) if re.match(r"--?[A-Za-z]", span)]


def test_readme_quick_start_commands_are_the_ones_ci_runs():
    blocks = [b.strip() for b in FENCE.findall(README.read_text())]
    assert all(cmd in blocks for cmd in QUICK_START)
    assert "`torch==2.13.0`" in README.read_text()


def test_every_ninfer_command_and_flag_the_readme_shows_exists():
    text = README.read_text()
    commands = [c for c in readme_commands(text) if c[0] == "ninfer"]
    shown = {tuple(c[1:3]) for c in commands}
    # the check reads the commands a newcomer needs: a README without them would pass vacuously
    assert {("run", "smollm2-135m"), ("serve", "--detach"), ("launch", "claude|codex|opencode|aider"),
            ("profiles", "fit")} <= shown, shown
    problems = {" ".join(c): p for c in commands if (p := cli_problems(c[1:]))}
    assert not problems
    options = {s: a for _, p in _parsers(build_parser()) for a in p._actions for s in a.option_strings}
    bad = []
    for span in readme_flag_spans(text):
        flag, _, value = span.replace("=", " ").partition(" ")
        for name in flag.split("/"):
            action = options.get(name)
            if action is None:
                bad.append(span)
            elif action.choices and value and not value.isupper():
                bad += [span for v in value.split("|") if v not in action.choices]
    assert not bad


def test_every_script_command_the_readme_shows_takes_its_flags():
    scripts = [c for c in readme_commands(README.read_text()) if c[0] in ("python", "python3", "bash")
               and len(c) > 1 and c[1].startswith("scripts/")]
    assert scripts
    for command in scripts:
        source = ROOT / command[1]
        assert source.is_file(), command[1]
        code = source.read_text()
        missing = [f for f in command[2:] if f.startswith("--") and f'"{f}"' not in code and f"'{f}'" not in code]
        assert not missing, (command[1], missing)


def test_every_file_the_readme_links_or_quotes_exists():
    assert not broken_links(README)
    linked = LINK.findall(README.read_text())
    assert "tests/__snapshots__/test_app_snapshots/test_main_screen.svg" in linked
    assert {f"docs/{n}.md" for n in ("architecture", "performance", "kernels", "profiles", "api",
                                     "troubleshooting")} <= set(linked)
    assert not [p for p in QUOTED_PATH.findall(README.read_text()) if not (ROOT / p.rstrip("/")).exists()]


def test_the_readme_checks_catch_what_does_not_exist():
    assert cli_problems(["frobnicate"]) and cli_problems(["serve", "--no-such-flag"])
    assert cli_problems(["launch", "emacs"]) and cli_problems(["run", "m", "--kv-dtype", "int4"])
    assert cli_problems(["profiles", "list|frob"])
    assert not cli_problems(["run", "MODEL", "--kv-dtype", "int8", "--", "--anything"])
    assert readme_commands("```bash\nninfer a && ninfer b --c | tee x  # ninfer d\n```\n`ninfer e`") == [
        ["ninfer", "a"], ["ninfer", "b", "--c"], ["tee", "x"], ["ninfer", "e"]]
