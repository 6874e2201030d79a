"""The engine must import and run without the front-end packages (GPU boxes carry only the engine's deps)."""
import subprocess
import sys

from .conftest import ROOT

BLOCK = """
import sys
class Block:
    def find_spec(self, name, path=None, target=None):
        if name.split('.')[0] in ('textual', 'prompt_toolkit', 'ninfer_tui'):
            raise ImportError('blocked: ' + name)
sys.meta_path.insert(0, Block())
import engine
from engine import Engine, EngineConfig, SamplingParams
import engine.loaders.gguf, engine.models.llama, engine.runtime.generate, engine.tokenizer.chat_template
import engine.server.app, engine.server.lifecycle, engine.memory_plan
print('ok')
"""


def test_engine_imports_without_front_end_packages():
    r = subprocess.run([sys.executable, "-c", BLOCK], capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "ok"


def test_engine_does_not_import_front_end():
    for path in (ROOT / "engine").rglob("*.py"):
        text = path.read_text()
        assert "ninfer_tui" not in text and "import textual" not in text, path


def test_wheel_ships_every_package():
    """The wheel's explicit package list names every package directory (an editable install hides a missing
    one; a plain `pip install .` then fails at import)."""
    import tomllib

    from .conftest import ROOT

    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = {".".join(p.parent.relative_to(ROOT).parts) for top in ("engine", "ninfer_tui")
             for p in (ROOT / top).rglob("__init__.py")}
    assert found <= listed, f"missing from [tool.setuptools] packages: {sorted(found - listed)}"
