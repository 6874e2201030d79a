"""Launch profiles: schema, built-ins, extends, CLI overrides, the memory-fit check, and bad files."""
import dataclasses
import json
import math
import os
import re
import sys
import textwrap

import pytest

from engine.config import WeightFormats
from engine.errors import UserError
from engine.loaders.synthetic import preset_spec
from engine.memory_plan import check_fit, plan_memory
from ninfer_tui import profiles

from .conftest import ROOT, run_cli

GIB = 1 << 30


def write_user(name: str, text: str):
    path = profiles.user_dir() / f"{name}.toml"
    path.write_text(textwrap.dedent(text))
    return path


def test_every_builtin_validates():
    names = set(profiles.builtin_files())
    assert {"cpu-default", "8k-speed", "256k-long", "8k-fp8", "multi-user"} <= names
    for name in names:
        p = profiles.load(name)
        assert p.builtin and p.description
        p.engine_config(p.model)


def test_profile_keys_are_the_engine_settings():
    """Every engine setting a user chooses is a profile key, checked by a rule, with EngineConfig's default; the
    profile keys besides them are about serving: a setting added to EngineConfig alone fails here."""
    from dataclasses import MISSING, fields

    from engine.config import EngineConfig

    def default(f):
        return f.default_factory() if f.default is MISSING else f.default

    engine = {f.name: f for f in fields(EngineConfig)}
    keys = {f.name: f for f in fields(profiles.Profile)}
    # no profile key: the tile cache and the CPU kernels are the cache dir's, the held conversations' files and the
    # record of verified shards the state dir's
    chosen = set(engine) - {"kernel_cache", "cpu_kernels_dir", "held_dir", "verified_shards", "seed", "extra"}
    assert chosen - {"weights"} == set(profiles.ENGINE_RULES) - {"description", "host", "port"}
    assert "weights" in profiles.TABLES
    assert set(keys) - {"name", "source", "builtin", "sampling"} == set(profiles.ENGINE_RULES) | {"weights"}
    for name in chosen - {"model"}:
        assert default(keys[name]) == default(engine[name]), name


def test_toml_round_trip(tmp_path):
    original = profiles.with_overrides(profiles.load("256k-long"), {"port": 30000, "sampling": {"top_k": 40}})
    path = tmp_path / "copy.toml"
    path.write_text(profiles.dump(original.to_dict()))
    again = profiles.load_path(path)
    assert again.to_dict() == original.to_dict()
    assert again.port == 30000 and again.sampling.top_k == 40 and again.weights.mlp == "q4"


def test_extends_chain_and_overrides_of_builtins():
    p = profiles.load("8k-fp8")
    assert p.kv_dtype == "fp8" and p.spec == "dflash" and p.weights.attn == "q5"
    write_user("mine", 'extends = "8k-fp8"\nmax_context = 16384\nkv_capacity = 16384\n[sampling]\ntop_k = 5\n')
    mine = profiles.load("mine")
    assert (mine.max_context, mine.kv_dtype, mine.sampling.top_k, mine.sampling.max_tokens) == (16384, "fp8", 5, 4096)
    # A user file named like a built-in overrides it and may extend it.
    write_user("8k-speed", 'extends = "8k-speed"\nport = 9000\n')
    assert profiles.load("8k-speed").port == 9000 and not profiles.load("8k-speed").builtin
    assert profiles.load("8k-fp8").port == 9000  # built-ins that extend it see the override


def test_extends_cycle_is_an_error():
    write_user("a", 'extends = "b"\n')
    write_user("b", 'extends = "a"\n')
    with pytest.raises(UserError, match="cycle: a -> b -> a"):
        profiles.load("a")


@pytest.mark.parametrize("body,needle", [
    ("max_context = 'big'\n", "key 'max_context' is a string ('big'); allowed: an integer"),
    ("kv_dtype = 'int4'\n", "key 'kv_dtype' = 'int4' is out of range; allowed: one of 'auto', 'bf16', 'fp8', 'int8'"),
    ("draft_tokens = 16\n", "key 'draft_tokens' = 16 is out of range; allowed: an integer >= 1 and <= 15"),
    ("colour = 'red'\n", "unknown key 'colour'"),
    ("[sampling]\ntemprature = 1.0\n", "unknown key 'sampling.temprature'"),
    ("[weights]\nmlp = 'q3'\n", "key 'weights.mlp' = 'q3' is out of range"),
    ("max_context = = 3\n", "not valid TOML"),
    ("extends = 'nowhere'\n", "no profile named 'nowhere'"),
    ("max_context = 16384\nkv_capacity = 8192\n", "kv_capacity (8192) is smaller than max_context"),
    ("[sampling]\ntemperature = nan\n", "key 'sampling.temperature' = nan is not a finite number; allowed: a finite "
     "number >= 0 and <= 5"),
])
def test_bad_file_names_file_and_key(tmp_path, body, needle):
    path = tmp_path / "bad.toml"
    path.write_text(body)
    r = run_cli("profiles", "validate", str(path))
    assert r.returncode == 2, r.stderr
    assert needle in r.stderr and "Traceback" not in r.stderr
    if "nowhere" not in needle:
        assert str(path) in r.stderr or "kv_capacity" in needle


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
def test_every_number_key_must_be_finite(value):
    """nan passes every range comparison; inf passes the open ones: each number key refuses both, in a file and
    from --set."""
    for key in [k for k, rule in profiles.SAMPLING_RULES.items() if rule.kind is float]:
        with pytest.raises(UserError, match=rf"key 'sampling.{key}' = -?(nan|inf) is not a finite number; allowed: "
                                            r"a finite number"):
            profiles.check_layer({"sampling": {key: value}}, "f.toml")
    with pytest.raises(UserError, match="command line: key 'sampling.top_p'"):
        profiles.with_overrides(profiles.load("cpu-default"), profiles.parse_set([f"sampling.top_p={value}"]))


def test_list_reports_each_bad_file_and_lists_the_good_ones():
    """Nesting past the parser's depth, bytes that are not UTF-8, a FIFO (never opened for a blocking read), a
    directory named like a profile, a non-finite number, and a profile extending a bad one."""
    d = profiles.user_dir()
    (d / "deep.toml").write_text("max_context = " + "[" * 5000 + "]" * 5000 + "\n")
    (d / "bytes.toml").write_bytes(b'description = "\xff\xfe"\n')
    os.mkfifo(d / "fifo.toml")
    (d / "folder.toml").mkdir()
    (d / "nan.toml").write_text("[sampling]\ntemperature = nan\n")
    (d / "child.toml").write_text('extends = "nan"\n')
    write_user("fine", 'extends = "cpu-default"\nmax_context = 4096\n')
    r = run_cli("profiles", "list", timeout=60)
    assert r.returncode == 0, r.stderr
    assert re.search(r"^  fine +user", r.stdout, re.M) and re.search(r"^  cpu-default +built-in", r.stdout, re.M)
    warnings = [line for line in r.stderr.splitlines() if line.startswith("warning: ")]
    assert len(warnings) == 6
    for name, cause in [("deep", "nested too deeply"), ("bytes", "is not UTF-8 text (byte 0xff at offset 15)"),
                        ("fifo", "is a FIFO, not a profile file"), ("folder", "is a directory, not a profile file"),
                        ("nan", "'sampling.temperature' = nan is not a finite number")]:
        assert any(w.startswith(f"warning: profile {name} skipped: {d / name}.toml: ") and cause in w
                   for w in warnings), name
    assert f"warning: profile child ({d / 'child.toml'}) skipped: {d / 'nan.toml'}: " in r.stderr
    assert "Traceback" not in r.stderr


def test_validate_takes_a_name_or_a_file(tmp_path):
    write_user("mine", 'extends = "cpu-default"\nmax_context = 4096\n')
    assert profiles.validate("mine").max_context == 4096
    assert profiles.validate("8k-fp8").kv_dtype == "fp8"
    path = tmp_path / "mine"  # a file without the .toml suffix is still a file
    path.write_text("max_context = 2048\n")
    assert profiles.validate(str(path)).max_context == 2048
    with pytest.raises(UserError, match="no profile named 'nosuch'"):
        profiles.validate("nosuch")
    r = run_cli("profiles", "validate", "mine")
    assert r.returncode == 0 and "mine: valid (profile mine" in r.stdout, r.stderr


def test_bad_user_profile_fails_engine_commands_with_exit_2():
    write_user("broken", "prefill_chunk = 0\n")
    r = run_cli("generate", "--profile", "broken", "--prompt", "hi")
    assert r.returncode == 2
    assert "broken.toml: key 'prefill_chunk' = 0 is out of range" in r.stderr


def test_cli_overrides_reach_the_engine():
    # The profile's context is 8192; --set and --max-context override it (the error quotes the new window).
    r = run_cli("generate", "--prompt", "hi", "-n", "300", "--set", "max_context=256", "--json")
    assert r.returncode == 2 and "context window (256 tokens)" in r.stderr
    r = run_cli("generate", "--prompt", "hi", "-n", "300", "--max-context", "200", "--json")
    assert r.returncode == 2 and "context window (200 tokens)" in r.stderr
    write_user("short", 'extends = "cpu-default"\n[sampling]\nmax_tokens = 3\ntemperature = 0.0\n')
    out = json.loads(run_cli("generate", "--profile", "short", "--prompt", "Once upon", "--json").stdout)
    assert out["completion_tokens"] <= 3


def test_first_run_picks_cpu_default_and_says_so():
    r = run_cli("generate", "--prompt-ids", "1,2,3", "-n", "2", "--temperature", "0")
    assert r.returncode == 0, r.stderr
    assert "first run: using profile cpu-default (no CUDA GPU found)" in r.stderr
    again = run_cli("generate", "--prompt-ids", "1,2,3", "-n", "2", "--temperature", "0")
    assert "first run" not in again.stderr  # the pick was saved
    assert "* cpu-default" in run_cli("profiles", "list").stdout


def test_new_use_show_edit_rm(tmp_path):
    assert run_cli("profiles", "new", "work", "--from", "cpu-default").returncode == 0
    assert run_cli("profiles", "use", "work").returncode == 0
    rows = json.loads(run_cli("profiles", "list", "--json").stdout)
    assert next(r for r in rows if r["name"] == "work")["default"]
    editor = tmp_path / "editor.py"
    editor.write_text("import sys\nopen(sys.argv[1], 'a').write('max_context = 4096\\n')\n")
    r = run_cli("profiles", "edit", "work", env={"EDITOR": f"{sys.executable} {editor}"})
    assert r.returncode == 0, r.stderr
    assert json.loads(run_cli("profiles", "show", "work", "--json").stdout)["max_context"] == 4096
    # An edit that does not validate is rolled back.
    editor.write_text("import sys\nopen(sys.argv[1], 'a').write('max_context = -1\\n')\n")
    r = run_cli("profiles", "edit", "work", env={"EDITOR": f"{sys.executable} {editor}"})
    assert r.returncode == 2 and "previous version was restored" in r.stderr
    assert json.loads(run_cli("profiles", "show", "work", "--json").stdout)["max_context"] == 4096
    assert run_cli("profiles", "rm", "cpu-default").returncode == 2
    assert run_cli("profiles", "rm", "work").returncode == 0
    assert "work" not in run_cli("profiles", "list").stdout


# ---- the memory-fit check against hand-computed numbers ---------------------------------------------------

def _q(numel: int, bits: int) -> int:  # group-wise format: codes + one 2-byte scale per 64 weights
    return numel * bits // 8 + numel // 64 * 2


def test_fit_27b_by_hand():
    spec = preset_spec("qwen3.6-27b")
    p8k = profiles.load("8k-speed").engine_config("x")
    plan = plan_memory(spec, p8k, "cuda")
    # KV: 16 full-attention layers x K,V x 4 kv heads x (256 int8 codes + one fp32 scale) per token.
    # The pool holds 24K tokens (two running requests and a held conversation) in blocks of 64, plus the scratch
    # block.
    assert plan.kv_pool == (24576 + 64) * 16 * 2 * 4 * (256 + 4) == 820_019_200
    # GDN state per sequence: 48 layers x (3 conv rows x 10240 channels bf16 + 48 heads x 128 x 128 fp32).
    per_slot = 48 * 3 * 10240 * 2 + 48 * 48 * 128 * 128 * 4
    assert plan.state_bytes_per_slot == per_slot
    assert plan.state_slots == (2 + 3) * (2 + 2) * per_slot  # two running, two held
    # per lane (two): a K=7 verify step's kept GDN inputs: 8 conv output rows + raw b, a, and an 11-row conv
    # window, bf16; and a graphed prefill piece's: 16 rows and a 19-row window; the batch verify graph of both
    # lanes keeps a verify step's inputs for each of them again
    verify = 48 * (8 * (10240 + 2 * 48) + 11 * 10240) * 2
    piece = 48 * (16 * (10240 + 2 * 48) + 19 * 10240) * 2
    assert plan.spec_states == 2 * (verify + piece) + 2 * verify
    # K=15: a verify step is a prefill piece's size, and the pieces replay its graph: one 16-row keep per lane
    k15 = plan_memory(spec, dataclasses.replace(p8k, draft_tokens=15), "cuda")
    assert k15.spec_states == 2 * piece + 2 * piece
    assert k15.graphs < plan.graphs
    h, inter, vocab = 5120, 17408, 248320
    mlp = 64 * _q(3 * h * inter, 4)
    gdn = 48 * (_q(10240 * h, 5) + _q(6144 * h, 5) + 2 * _q(48 * h, 5) + _q(h * 6144, 5))
    attn = 16 * (_q(12288 * h, 5) + 2 * _q(1024 * h, 5) + _q(h * 6144, 5))
    emb = 2 * _q(vocab * h, 8)
    # Unquantized: per GDN layer conv1d (10240 x 4) + norm (128) in bf16, A_log and dt_bias (48 each) in fp32;
    # per attention layer q_norm + k_norm (256 each); two layer norms per layer and the final norm (5120 each).
    small = 48 * ((10240 * 4 + 128) * 2 + 2 * 48 * 4) + 16 * 2 * 256 * 2 + (64 * 2 + 1) * h * 2
    assert plan.weights == mlp + gdn + attn + emb + small
    assert 15.2 * GIB < plan.weights < 15.5 * GIB
    assert check_fit(plan, 24 * GIB).fits

    plong = plan_memory(spec, profiles.load("256k-long").engine_config("x"), "cuda")
    # fp8 codes + scales: the same bytes as int8
    assert plong.kv_pool == (262144 + 64) * 16 * 2 * 4 * (256 + 4) == 8_726_282_240
    verdict = check_fit(plong, 24 * GIB)
    # short by ~3 GiB: the advice names the first part that closes the gap alone, the KV pool (held
    # conversations live in it, so they cost no more: 256K fits a 32 GB card)
    assert not verdict.fits and verdict.advice.startswith("short by") and "KV pool" in verdict.advice
    assert "lower max_context / kv_capacity" in verdict.advice
    assert "fp8" not in verdict.advice  # it already has 8-bit KV: the knob left is the pool's size
    assert check_fit(plong, 32 * GIB).fits
    bf16 = profiles.with_overrides(profiles.load("256k-long"), {"kv_dtype": "bf16"})
    assert "use kv_dtype int8 or fp8" in check_fit(plan_memory(spec, bf16.engine_config("x"), "cuda"), 32 * GIB).advice


def test_fit_tiny_by_hand():
    from engine.config import EngineConfig

    spec = preset_spec("tiny")
    cfg = EngineConfig(model="x", device="cpu", max_context=1024, kv_dtype="auto")
    plan = plan_memory(spec, cfg, "cpu")
    # one attention layer, fp32 on CPU; by default room for the running request and two held conversations, and
    # the scratch block
    assert plan.kv_pool == (3 * 1024 + 64) * 1 * 2 * 2 * 32 * 4
    assert plan.state_bytes_per_slot == 3 * 3 * 128 * 4 + 3 * 4 * 16 * 16 * 4
    assert plan.runtime == 0 and plan.graphs == 0
    q = plan_memory(spec, EngineConfig(model="x", weights=WeightFormats.uniform("q8")), "cpu")
    assert q.weights < plan.weights


def test_readme_fit_figures_are_the_plans():
    """The figures README quotes come from the same computation as `profiles fit`."""
    text = " ".join((ROOT / "README.md").read_text(encoding="utf-8").split())
    spec = preset_spec("qwen3.6-27b")

    def plan(name, **keys):
        return plan_memory(spec, profiles.with_overrides(profiles.load(name), keys).engine_config("x"), "cuda")

    def gib(n: int) -> str:
        return f"{n / GIB:.1f}"

    assert f"`8k-speed` needs {gib(plan('8k-speed').device_total)} GiB" in text
    assert f"`256k-long` {gib(plan('256k-long').device_total)} GiB" in text
    tier = plan("256k-long", host_kv_mib=40960, host_state_slots=8)
    assert (f"needs {gib(tier.device_total)} GiB on the GPU (a 32 GB card) and up to {gib(tier.host_total)} GiB of "
            "RAM") in text


def test_fit_cli_with_card_size():
    r = run_cli("profiles", "fit", "256k-long", "--gpu-mem-gib", "24", "--json")
    out = json.loads(r.stdout)
    assert r.returncode == 2 and out["fits"] is False and out["plan"]["kv_pool"] == 8_726_282_240
    assert "fp8" not in out["advice"]
    r = run_cli("profiles", "fit", "8k-speed", "--gpu-mem-gib", "24")
    assert r.returncode == 0 and "FITS: needs 20.74" in r.stdout
    if not os.environ.get("CUDA_VISIBLE_DEVICES"):
        r = run_cli("profiles", "fit", "8k-speed")
        assert r.returncode in (0, 2)
