"""EngineConfig: every setting the engine reads, validated once."""
from __future__ import annotations

from dataclasses import dataclass, field

from .errors import UserError

KV_DTYPES = ("auto", "bf16", "fp8", "int8")
DEVICES = ("auto", "cpu", "cuda")
DTYPES = ("auto", "float64", "float32", "bfloat16", "float16")


@dataclass(frozen=True)
class EngineConfig:
    """What the engine needs to load a model and run requests.

    `model` is a resolved path (a .gguf file or a HF folder) or `synthetic:PRESET`; registry names are
    resolved by the front end before the engine sees them.
    """

    model: str
    device: str = "auto"
    dtype: str = "auto"
    max_context: int = 8192
    kv_dtype: str = "auto"
    prefill_chunk: int = 512
    max_concurrency: int = 1
    max_pending_requests: int = 8
    seed: int = 0
    extra: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        _choice("device", self.device, DEVICES)
        _choice("dtype", self.dtype, DTYPES)
        _choice("kv_dtype", self.kv_dtype, KV_DTYPES)
        for name in ("max_context", "prefill_chunk", "max_concurrency"):
            if getattr(self, name) < 1:
                raise UserError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.max_pending_requests < 0:
            raise UserError(f"max_pending_requests must be >= 0, got {self.max_pending_requests}")


def _choice(name: str, value: str, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise UserError(f"{name} = {value!r} is not one of {', '.join(allowed)}")
