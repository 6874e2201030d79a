"""ninfer's inference engine. Importable without any front-end package (Textual, prompt_toolkit)."""
from .config import EngineConfig
from .engine import Engine
from .errors import ContextOverflowError, ModelFormatError, NinferError, UserError
from .runtime.request import FinishEvent, SamplingParams, Timings, TokenEvent

__all__ = [
    "ContextOverflowError", "Engine", "EngineConfig", "FinishEvent", "ModelFormatError", "NinferError",
    "SamplingParams", "Timings", "TokenEvent", "UserError",
]
__version__ = "0.1.0"
