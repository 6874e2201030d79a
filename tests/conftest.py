import os
import shutil
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from engine.models.presets import TINY_VISION, TINY_VL

ROOT = Path(__file__).resolve().parent.parent

# Kernel tests at real sizes run where a GPU is asked for (NINFER_TEST_DEVICE=cuda); CI has none.
gpu_only = pytest.mark.skipif(os.environ.get("NINFER_TEST_DEVICE") != "cuda",
                              reason="GPU run (NINFER_TEST_DEVICE=cuda)")

# ---- isolation: the run touches nothing outside its temporary directories ---------------------------------------
# Set in pytest_configure, before any fixture starts a process (servers, CLIs and agent clients inherit them), and
# again for each test on top (_isolated_dirs). Both ninfer's own dirs and the home ones move: agent clients and npm
# write ~/.config, ~/.local/share and ~/.npm.
PER_TEST_DIRS = ("HOME", "XDG_CONFIG_HOME", "XDG_DATA_HOME", "XDG_STATE_HOME",
                 "NINFER_CONFIG_DIR", "NINFER_DATA_DIR", "NINFER_STATE_DIR")
# Caches the whole run shares: npm's and pip's downloads, Triton's compiled kernels, the kernel-tile timings.
RUN_CACHES = ("XDG_CACHE_HOME", "NINFER_CACHE_DIR", "TRITON_HOME", "npm_config_cache")
# The user's own ninfer dirs and home, resolved from the environment the run started with: what must stay
# untouched. An xdist worker starts with its controller's moved environment, so it reads them from USER_ENV.
USER_DIRS: dict[str, Path] = {}
USER_HOME = Path.home()
USER_ENV = "NINFER_TESTS_USER_DIRS"
_USER_FILES: dict[str, dict[str, float]] = {}
# The run's temporary root, and under it the dirs that session- and module-scoped fixtures' processes see.
SANDBOX: dict[str, Path] = {}


def _files(folder: Path) -> dict[str, float]:
    """Every file under `folder`, with its modification time."""
    return {str(p): p.stat().st_mtime for p in folder.rglob("*") if p.is_file()} if folder.is_dir() else {}


def _point(names, base: Path) -> None:
    for name in names:
        folder = base / name.lower()
        folder.mkdir(parents=True, exist_ok=True)
        os.environ[name] = str(folder)


def _user_dirs() -> dict[str, str]:
    import platformdirs

    from ninfer_tui import paths

    dirs = {kind: os.environ.get(f"NINFER_{kind.upper()}_DIR") or getattr(platformdirs, f"user_{kind}_dir")(paths.APP)
            for kind in ("config", "data", "state", "cache")}
    return {**dirs, "home": str(Path.home())}


def pytest_configure(config):
    global USER_HOME
    import json

    import platformdirs

    from ninfer_tui import paths

    if USER_ENV not in os.environ:
        os.environ[USER_ENV] = json.dumps(_user_dirs())
    user = {kind: Path(folder) for kind, folder in json.loads(os.environ[USER_ENV]).items()}
    USER_HOME = user.pop("home")
    for kind, folder in user.items():
        USER_DIRS[kind] = folder
        _USER_FILES[kind] = _files(folder)
    # The pulled models stay where `ninfer pull` put them, and npm and pip keep the registries the user set up:
    # all read only.
    os.environ["NINFER_MODELS_DIR"] = str(paths.models_dir())
    for var, path in (("npm_config_userconfig", Path.home() / ".npmrc"),
                      ("PIP_CONFIG_FILE", Path(platformdirs.user_config_dir("pip")) / "pip.conf")):
        if path.is_file():
            os.environ.setdefault(var, str(path))
    if os.environ.get("PYTEST_XDIST_WORKER"):
        # Two workers share the two cores: a worker's torch, numpy and the processes it starts each run one
        # thread, where each would start a thread per core and the four would wait on each other.
        os.environ.setdefault("OMP_NUM_THREADS", "1")
    SANDBOX["root"] = Path(tempfile.mkdtemp(prefix="ninfer-tests-"))
    SANDBOX["run"] = SANDBOX["root"] / "run"
    _point(RUN_CACHES, SANDBOX["root"] / "caches")
    _point(PER_TEST_DIRS, SANDBOX["run"])


@pytest.hookimpl(optionalhook=True)  # a run without xdist (-p no:xdist) has no such hook
def pytest_xdist_auto_num_workers(config) -> int:
    """`-n auto` (pyproject's addopts): two workers on the CPU, where most of the suite's time goes to
    single-threaded processes (CLI runs, servers, interpreter checks) and a second core would idle; one on a GPU,
    whose tests each want the whole card."""
    return 1 if os.environ.get("NINFER_TEST_DEVICE") == "cuda" else 2


def pytest_unconfigure(config):
    try:
        if "process" in _CHECKS:
            _CHECKS.pop("process").close()
    finally:
        if "root" in SANDBOX:
            shutil.rmtree(SANDBOX["root"], ignore_errors=True)


def leaked_files() -> list[str]:
    """Files this run added to the user's own ninfer dirs, or changed in the config dir (the user's own servers
    and chats may write the others while the suite runs)."""
    return sorted(p for kind, folder in USER_DIRS.items() for p, mtime in _files(folder).items()
                  if p not in _USER_FILES[kind] or (kind == "config" and _USER_FILES[kind][p] != mtime))


@pytest.fixture(autouse=True)
def _isolated_dirs(tmp_path_factory, monkeypatch):
    """Profiles, settings, sessions, pidfiles and the clients' home dirs of each test are its own."""
    base = tmp_path_factory.mktemp("ninfer-home")
    for name in PER_TEST_DIRS:
        (base / name.lower()).mkdir()
        monkeypatch.setenv(name, str(base / name.lower()))


def idle(engine, timeout: float = 30.0) -> tuple[int, int]:
    """The engine's (running, pending) once both are 0, or as they are after `timeout` s: a cancelled request
    gives its place back at the engine core's next step."""
    import time

    deadline = time.monotonic() + timeout
    while True:
        stats = engine.stats()
        gauges = (stats["running"], stats["pending"])
        if gauges == (0, 0) or time.monotonic() > deadline:
            return gauges
        time.sleep(0.01)


@contextmanager
def admitted_together(engine) -> Iterator[None]:
    """Requests submitted inside are admitted by the same engine-core step: the core's loop waits for the
    scheduler's lock, held here (on a busy machine the first request could otherwise run several steps, or to its
    end, before the next one is submitted)."""
    with engine.core.scheduler.lock:
        yield


def rel_error(got, want) -> float:
    """||got - want|| / ||want||, in float64 on the CPU (the measure every kernel and oracle test bounds)."""
    got, want = got.double().cpu(), want.double().cpu()
    return ((got - want).norm() / want.norm()).item()


@pytest.fixture(scope="session")
def default_model_path() -> str:
    from ninfer_tui.models import resolve

    return resolve("smollm2-135m", announce=False)


@pytest.fixture(scope="session")
def default_engine(default_model_path):
    from engine import Engine, EngineConfig

    return Engine(EngineConfig(model=default_model_path, device="cpu", dtype="float32"))


@pytest.fixture(scope="session")
def api_server():
    """`ninfer serve` of the default model on loopback, started once for the API tests of every module."""
    from .server_util import Server

    server = Server()
    yield server
    server.stop()


def run_cli(*args: str, stdin: str | None = None, env: dict | None = None, timeout: int = 300):
    import subprocess

    full_env = {**os.environ, **(env or {})}
    return subprocess.run([sys.executable, "-m", "ninfer_tui.cli", *args], input=stdin, capture_output=True,
                          text=True, env=full_env, timeout=timeout, cwd=ROOT)


# ---- kernel checks in the Triton interpreter ------------------------------------------------------------------
INTERPRETED = {"TRITON_INTERPRET": "1", "NINFER_TRITON_ON_CPU": "1"}
_CHECKS: dict = {}  # the run's CheckProcess, started by the first check


def interpret(code: str) -> float:
    """Run `code` with Triton kernels in the interpreter on the CPU, as `python -c` would in a process of its own
    (the interpreter is chosen before triton is imported) with this test's environment, and return the number its
    last output line prints."""
    if "process" not in _CHECKS or _CHECKS["process"].proc.poll() is not None:  # none yet, or it died
        _CHECKS["process"] = CheckProcess()
    status, out, err = _CHECKS["process"].run(code, {**os.environ, **INTERPRETED})
    assert status == 0, f"exit status {status}\n{err}"
    return float(out.strip().splitlines()[-1])


class CheckProcess:
    """A process that imports torch and Triton (in interpreter mode) once and forks a child for each check: the
    child starts as a fresh `python -c` would, without paying those imports (~5 s of CPU) again."""

    def __init__(self) -> None:
        import subprocess

        self.log = SANDBOX["root"] / "check-process.log"
        with self.log.open("w") as log:
            self.proc = subprocess.Popen([sys.executable, "-c", "from tests.conftest import serve_checks; "
                                          "serve_checks()"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                         stderr=log, text=True, cwd=ROOT, env={**os.environ, **INTERPRETED})

    def run(self, code: str, env: dict) -> tuple[int, str, str]:
        import json

        try:
            self.proc.stdin.write(json.dumps([code, env]) + "\n")
            self.proc.stdin.flush()
            answer = self.proc.stdout.readline()
        except BrokenPipeError:
            answer = ""
        if not answer:
            raise RuntimeError(f"the check process ended:\n{self.log.read_text()}")
        return tuple(json.loads(answer))

    def close(self) -> None:
        """End of input ends the process after the check in hand; one still running a minute later (a check
        interrupted mid-way) is terminated, and takes its check's child with it."""
        import subprocess

        self.proc.stdin.close()
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.terminate()
            self.proc.wait(10)


def serve_checks() -> None:
    """CheckProcess's own loop: each [code, env] line on stdin runs in a forked child, and the answer is a line
    [exit status, stdout, stderr]. Nothing here runs a torch op, so no thread pool is started before a fork."""
    import json
    import signal
    import tempfile

    import torch.nn.attention  # noqa: F401  (it imports torch._dynamo: most of a check's import time)
    import triton  # noqa: F401

    child: dict[str, int] = {}

    def end(signum, frame):  # CheckProcess.close's terminate: the running check's child goes too
        if "pid" in child:
            os.kill(child["pid"], signal.SIGKILL)
        os._exit(1)

    signal.signal(signal.SIGTERM, end)
    for line in sys.stdin:
        code, env = json.loads(line)
        with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
            pid = os.fork()
            if pid == 0:
                try:
                    _run_check(code, env, out.fileno(), err.fileno())
                finally:  # whatever happens, the child never goes on into this loop
                    os._exit(1)
            child["pid"] = pid
            status = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
            child.pop("pid")
            out.seek(0)
            err.seek(0)
            answer = [status, out.read().decode(errors="replace"), err.read().decode(errors="replace")]
        print(json.dumps(answer), flush=True)


def _run_check(code: str, env: dict, out: int, err: int) -> None:
    """In the forked child: run `code` as `python -c` would, with `env` as its environment. Never returns."""
    import signal
    import traceback

    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # the serving loop's handler is not the check's
    os.dup2(out, 1)
    os.dup2(err, 2)
    os.environ.clear()
    os.environ.update(env)
    signal.alarm(600)  # the time limit a check had as a subprocess of its own
    status = 0
    try:
        exec(compile(code, "<string>", "exec"), {"__name__": "__main__"})
    except SystemExit as exc:  # sys.exit(): what `python -c` would exit with
        if exc.code is None or isinstance(exc.code, int):
            status = exc.code or 0
        else:
            print(exc.code, file=sys.stderr)
            status = 1
    except BaseException:
        traceback.print_exc()
        status = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


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


def write_tiny(out: Path, seed: int = 0, vision: dict | None = None, **overrides) -> Path:
    """A tiny random Qwen3.5 folder written through transformers (scripts/make_synthetic_model.py), for an oracle
    on transformers' torch paths."""
    import importlib.util

    oracle_on_torch_paths()

    spec = importlib.util.spec_from_file_location("make_synthetic_model", ROOT / "scripts" / "make_synthetic_model.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    from engine.models.presets import TINY

    return mod.write_synthetic(out, {**TINY, **overrides}, seed, vision)


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


# A tiny Qwen3.5 vision-language folder (transformers' Qwen3_5ForConditionalGeneration): the tiny-vl preset's tower
# and rope (partial rotary 0.5 of 32: 8 frequencies, so that time, row and column each turn several).
VISION = TINY_VISION
VISION_ROPE = TINY_VL["rope_parameters"]


def make_video(frames: int = 10, width: int = 64, height: int = 48, fps: int = 4, codec: str = "libx264",
               container: str = "mp4", seed: int = 0) -> bytes:
    """A small video file encoded with PyAV: colour gradients that move from frame to frame, and some noise."""
    import io

    import av
    import numpy as np

    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width]
    buf = io.BytesIO()
    with av.open(buf, "w", format=container) as out:
        # x264's threads (its lookahead's too) make its output depend on their timing: one thread each, so the
        # same frames make the same file every time (the tests key prepared videos by their bytes)
        one_thread = {"x264-params": "threads=1:lookahead-threads=1:sync-lookahead=0"} if codec == "libx264" else None
        stream = out.add_stream(codec, rate=fps, options=one_thread)
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        for i in range(frames):
            rgb = np.stack([x * 4 + i * 20, y * 5 + i * 7, (x + y) * 3 + seed * 40], -1) % 256
            rgb = (rgb + rng.integers(0, 24, rgb.shape)).clip(0, 255).astype(np.uint8)
            out.mux(stream.encode(av.VideoFrame.from_ndarray(rgb, format="rgb24")))
        out.mux(stream.encode())
    return buf.getvalue()


@pytest.fixture(scope="session")
def vl_folder(tmp_path_factory):
    return write_tiny(tmp_path_factory.mktemp("tiny-vl"), seed=7, vision=VISION, rope_parameters=VISION_ROPE)


@pytest.fixture(scope="session")
def vl_engine(vl_folder):
    """One engine on it for every test of a process (images up to 64x64 pixels: 16 pad tokens); on a GPU with
    NINFER_TEST_DEVICE=cuda (fp32, CUDA graphs on: requests with images run in the lanes, their prompt
    eagerly, their decode steps in the graphs)."""
    from engine import Engine, EngineConfig

    return Engine(EngineConfig(model=str(vl_folder), device=os.environ.get("NINFER_TEST_DEVICE", "cpu"),
                               dtype="float32", image_max_pixels=64 * 64, max_concurrency=2))


# llama.cpp's convert_hf_to_gguf.py run from its source tree (argv: the tree, then the converter's arguments). The
# tiny models' byte-level tokenizer is unknown to the converter's pre-tokenizer table (a hash of how it splits a
# test text); llama.cpp splits with Qwen3.5's own rule, which gives a merge-free byte vocabulary the same ids.
LLAMA_CPP_CONVERT = """
import runpy, sys
from pathlib import Path
root = Path(sys.argv[1])
sys.argv = [str(root / "convert_hf_to_gguf.py"), *sys.argv[2:]]
sys.path[:0] = [str(root), str(root / "gguf-py")]
from conversion.base import TextModel
TextModel.get_vocab_base_pre = lambda self, tokenizer: "qwen35"
runpy.run_path(sys.argv[0], run_name="__main__")
"""
