"""ninfer's inference engine. Importable without any front-end package (Textual, prompt_toolkit)."""
from .config import EngineConfig
from .errors import ContextOverflowError, ModelFormatError, NinferError, UserError
from .media import IMAGE_MARKER, IMAGE_SLOT, VIDEO_MARKER, VIDEO_SLOT
from .runtime.request import FinishEvent, Grammar, SamplingParams, Timings, TokenEvent

__all__ = [
    "IMAGE_MARKER", "IMAGE_SLOT", "VIDEO_MARKER", "VIDEO_SLOT", "ContextOverflowError", "Engine", "EngineConfig",
    "FinishEvent", "Grammar", "ModelFormatError", "NinferError", "SamplingParams", "Timings", "TokenEvent", "UserError",
]
__version__ = "0.1.0"


def __getattr__(name: str):
    # Engine pulls in torch (seconds): imported on first use, so front ends that only read errors, settings or
    # sampling params (`ninfer --help`, `ninfer ps`) start at once.
    if name == "Engine":
        from .engine import Engine

        return Engine
    raise AttributeError(f"module 'engine' has no attribute {name!r}")
