import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

# Kernel tests at real sizes run where a GPU is asked for (NINFER_TEST_DEVICE=cuda); CI has none.
gpu_only = pytest.mark.skipif(os.environ.get("NINFER_TEST_DEVICE") != "cuda",
                              reason="GPU run (NINFER_TEST_DEVICE=cuda)")


def rel_error(got, want) -> float:
    """||got - want|| / ||want||, in float64 on the CPU (the measure every kernel and oracle test bounds)."""
    got, want = got.double().cpu(), want.double().cpu()
    return ((got - want).norm() / want.norm()).item()


@pytest.fixture(autouse=True)
def _isolated_dirs(tmp_path_factory, monkeypatch):
    """Profiles, settings, sessions and pidfiles of tests never touch the user's own (models stay cached)."""
    base = tmp_path_factory.mktemp("ninfer-home")
    for var in ("NINFER_CONFIG_DIR", "NINFER_DATA_DIR", "NINFER_STATE_DIR"):
        monkeypatch.setenv(var, str(base / var.lower()))


@pytest.fixture(scope="session")
def default_model_path() -> str:
    from ninfer_tui.models import resolve

    return resolve("smollm2-135m", announce=False)


@pytest.fixture(scope="session")
def default_engine(default_model_path):
    from engine import Engine, EngineConfig

    return Engine(EngineConfig(model=default_model_path, device="cpu", dtype="float32"))


def run_cli(*args: str, stdin: str | None = None, env: dict | None = None, timeout: int = 300):
    import subprocess

    full_env = {**os.environ, **(env or {})}
    return subprocess.run([sys.executable, "-m", "ninfer_tui.cli", *args], input=stdin, capture_output=True,
                          text=True, env=full_env, timeout=timeout, cwd=ROOT)


def interpret(code: str) -> float:
    """Run `code` with Triton kernels in the interpreter on the CPU (set before triton is imported, hence a
    subprocess) and return the number its last output line prints."""
    import subprocess

    env = {**os.environ, "TRITON_INTERPRET": "1", "NINFER_TRITON_ON_CPU": "1"}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=ROOT, timeout=600)
    assert r.returncode == 0, r.stderr
    return float(r.stdout.strip().splitlines()[-1])


def defined(code: str) -> dict:
    """The names `code` defines, run in this process: the GPU side of a check whose source `interpret` runs in
    the interpreter."""
    names: dict = {}
    exec(code, names)
    return names


def hf_greedy(model, ids: list[int], n: int) -> list[int]:
    """Greedy decoding through transformers' forward and cache, with no EOS handling (generate() would stop or
    mask EOS; here both sides run exactly n steps)."""
    import torch

    out, past = [], None
    step = torch.tensor([ids])
    with torch.inference_mode():
        for _ in range(n):
            res = model(step, past_key_values=past, use_cache=True)
            past = res.past_key_values
            out.append(int(res.logits[0, -1].argmax()))
            step = torch.tensor([[out[-1]]])
    return out


def oracle_on_torch_paths() -> None:
    """transformers 5.17 (the GPU image's) binds its Qwen3.5 to fla-core's kernels when the module is imported
    wherever fla-core is installed, CPU tensors included (where those Triton kernels fail; 5.25 checks the
    device), and on a GPU they round fp32 through TF32. So the oracle's module is imported (or imported again)
    with fla-core hidden, and binds transformers' own torch functions."""
    import importlib
    import importlib.util

    name = "transformers.models.qwen3_5.modeling_qwen3_5"
    if importlib.util.find_spec("fla") is None or getattr(sys.modules.get(name), "oracle_on_torch_paths", False):
        return
    absent = object()
    fla = sys.modules.get("fla", absent)
    sys.modules["fla"] = None  # an import of it raises ImportError
    try:
        module = importlib.reload(sys.modules[name]) if name in sys.modules else importlib.import_module(name)
    except ImportError:
        return  # no transformers: the oracle tests skip
    finally:
        if fla is absent:
            del sys.modules["fla"]
        else:
            sys.modules["fla"] = fla
    module.oracle_on_torch_paths = True


def write_tiny(out: Path, seed: int = 0, **overrides) -> Path:
    """A tiny random Qwen3.5 folder written through transformers (scripts/make_synthetic_model.py), for an oracle
    on transformers' torch paths."""
    import importlib.util

    oracle_on_torch_paths()

    spec = importlib.util.spec_from_file_location("make_synthetic_model", ROOT / "scripts" / "make_synthetic_model.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    from engine.models.presets import TINY

    return mod.write_synthetic(out, {**TINY, **overrides}, seed)


def compile_ahead(kernel, signature: dict[str, str], constexprs: dict, archs=(89, 90), warps: int = 4,
                  aligned: tuple[str, ...] = (), pdl: bool = False) -> list[str]:
    """PTX of a Triton kernel compiled for the users' RTX 4090 (sm_89) and the H200 (sm_90) by the installed
    Triton, no GPU needed: what a GPU run would first do with it. `aligned`: arguments a launch specializes as
    multiples of 16 (pointers to 16-byte-aligned tensors, such integers), which vector loads depend on. With
    `pdl`, the kernel's PDL constexpr is set as a launch sets it (on from sm_90, `engine.kernels.pdl`), and its
    grid-dependency wait must be in the PTX exactly there."""
    triton = pytest.importorskip("triton")
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    attrs = {(kernel.arg_names.index(a),): [["tt.divisibility", 16]] for a in aligned}
    out = []
    for arch in archs:
        consts = {**constexprs, "PDL": arch >= 90} if pdl else constexprs
        source = ASTSource(fn=kernel, signature={**signature, **{c: "constexpr" for c in consts}},
                           constexprs=consts, attrs=attrs)
        ptx = triton.compile(source, target=GPUTarget("cuda", arch, 32), options={"num_warps": warps}).asm["ptx"]
        if pdl:
            assert ("griddepcontrol.wait" in ptx) == (arch >= 90), f"sm_{arch}"
        out.append(ptx)
    return out
