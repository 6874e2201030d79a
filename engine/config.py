"""EngineConfig: every setting the engine reads, validated once."""
from __future__ import annotations

from dataclasses import dataclass, field, fields

from .errors import UserError

KV_DTYPES = ("auto", "bf16", "fp8", "int8")
DEVICES = ("auto", "cpu", "cuda")
DTYPES = ("auto", "float64", "float32", "bfloat16", "float16")
SPEC_METHODS = ("none", "mtp", "dflash", "ngram")
WEIGHT_FORMATS = ("auto", "bf16", "q8", "q5", "q4")
WEIGHT_LAYOUTS = ("auto", "rows", "tiles")
MAX_DRAFT_TOKENS = 7


@dataclass(frozen=True)
class WeightFormats:
    """The storage format of each class of weight tensor. "auto" keeps the checkpoint in the compute dtype.

    Norms, conv1d kernels and the GDN decay parameters are tiny and always stay in the compute dtype (or fp32).
    """

    attn: str = "auto"  # full-attention q/k/v/o projections
    gdn: str = "auto"  # Gated DeltaNet in/out projections
    mlp: str = "auto"  # SwiGLU gate/up/down
    embed: str = "auto"
    lm_head: str = "auto"

    def __post_init__(self) -> None:
        for f in fields(self):
            _choice(f"weights.{f.name}", getattr(self, f.name), WEIGHT_FORMATS)

    @classmethod
    def uniform(cls, fmt: str) -> WeightFormats:
        return cls(**{f.name: fmt for f in fields(cls)})

    def as_dict(self) -> dict[str, str]:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    def quantized(self) -> list[str]:
        """The tensor classes stored in a format other than the compute dtype."""
        return [k for k, v in self.as_dict().items() if v not in ("auto", "bf16")]


@dataclass(frozen=True)
class EngineConfig:
    """What the engine needs to load a model and run requests (every profile key the engine reads).

    `model` is a resolved path (a .gguf file or a HF folder) or `synthetic:PRESET`; registry names are
    resolved by the front end before the engine sees them.
    """

    model: str
    device: str = "auto"
    dtype: str = "auto"
    weights: WeightFormats = field(default_factory=WeightFormats)
    weight_layout: str = "auto"  # q4/q5 storage: "tiles", "rows" or "auto" (see `tiled_weights`)
    max_context: int = 8192
    kv_capacity: int = 0  # tokens in the KV pool; 0 = max_context x (max_concurrency + held_sequences)
    kv_dtype: str = "auto"
    prefill_chunk: int = 512
    graph_prefill_tokens: int = 128  # prefill chunks this short run as graphed 16-token steps (0: always eager)
    max_concurrency: int = 1
    max_pending_requests: int = 8
    spec: str = "none"
    draft_tokens: int = MAX_DRAFT_TOKENS
    drafter: str = ""
    lm_head_draft: bool = False
    draft_vocab: int = 0  # drafts drawn from the first N token ids only (0: the whole vocabulary)
    host_kv_mib: int = 0
    host_state_slots: int = 0
    cuda_graphs: bool = True
    held_sequences: int = 2  # finished conversations kept for reuse by the next turn (LRU)
    kernel_cache: str = ""  # JSON file of kernel tiles chosen by timing on this GPU ("" = choose every launch)
    seed: int = 0
    extra: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        _choice("device", self.device, DEVICES)
        _choice("dtype", self.dtype, DTYPES)
        _choice("kv_dtype", self.kv_dtype, KV_DTYPES)
        _choice("spec", self.spec, SPEC_METHODS)
        _choice("weight_layout", self.weight_layout, WEIGHT_LAYOUTS)
        for name in ("max_context", "prefill_chunk", "max_concurrency"):
            if getattr(self, name) < 1:
                raise UserError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("max_pending_requests", "kv_capacity", "host_kv_mib", "host_state_slots",
                     "held_sequences", "graph_prefill_tokens"):
            if getattr(self, name) < 0:
                raise UserError(f"{name} must be >= 0, got {getattr(self, name)}")
        if not 1 <= self.draft_tokens <= MAX_DRAFT_TOKENS:
            raise UserError(f"draft_tokens must be in 1..{MAX_DRAFT_TOKENS}, got {self.draft_tokens}")
        if self.draft_vocab < 0 or self.draft_vocab % 64:
            raise UserError(f"draft_vocab must be 0 or a positive multiple of 64, got {self.draft_vocab}",
                            hint="e.g. 32768; 0 drafts over the whole vocabulary")
        if 0 < self.kv_capacity < self.max_context:
            raise UserError(f"kv_capacity ({self.kv_capacity}) is smaller than max_context ({self.max_context}): "
                            "one full-length request would not fit", hint="raise kv_capacity or set it to 0 (auto)")

    @property
    def kv_tokens(self) -> int:
        """Tokens the KV pool holds: by default room for every running request and every held conversation at
        max_context tokens each."""
        return self.kv_capacity or self.max_context * (self.max_concurrency + self.held_sequences)

    @property
    def drafter_weights(self) -> str:
        """A DFlash drafter's projections keep 8 bits when the target's are quantized (sliding-window drafters
        are reported to break at 4 bits), the compute dtype otherwise."""
        return "q8" if self.weights.quantized() else "auto"

    @property
    def tiled_weights(self) -> bool:
        """Whether q4/q5 weights are stored tiled for the CUDA matmuls (where they run; `kernels/qtiled.py`).
        "auto" tiles them when steps multiply several rows: drafts to verify, or concurrent requests batched
        into one step. There v18 on tiles took 0.74-0.94x v10's time per 27B matmul on the H200; one-row steps
        keep them row-major, where v7 took 0.90-0.96x v19's (NOTES.md, session (12))."""
        several = self.verify_tokens > 1 or self.max_concurrency > 1
        return self.weight_layout == "tiles" or (self.weight_layout == "auto" and several)

    @property
    def graph_lanes(self) -> int:
        """Sequences that run at once with CUDA graphs: one working cache (lane) each, its KV blocks taken from
        the pool per request. One with a drafter: its graphs are bound to one sequence's drafter state, so
        speculative requests take turns."""
        return 1 if self.spec != "none" else self.max_concurrency

    @property
    def verify_tokens(self) -> int:
        """Tokens per sequence in one decode/verify step: 1, or the drafts plus the bonus token."""
        return 1 if self.spec == "none" else self.draft_tokens + 1


def _choice(name: str, value: str, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise UserError(f"{name} = {value!r} is not one of {', '.join(allowed)}")
