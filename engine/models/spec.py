"""ModelSpec: the geometry of a model, from a HF config.json or GGUF metadata."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class RopeSpec:
    theta: float = 10000.0
    rotary_dim: int = 0  # dims of each head that rotate (NeoX halves); 0 means the whole head
    scaling_type: str | None = None  # None | "linear" | "llama3"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position: int = 8192


@dataclass(frozen=True)
class ModelSpec:
    arch: str  # "llama" | "qwen3_5"
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_eps: float
    rope: RopeSpec
    tie_embeddings: bool
    max_position: int = 8192
    # Qwen3.5 hybrid geometry (unused by llama)
    layer_types: tuple[str, ...] = ()
    attn_output_gate: bool = False
    linear_num_key_heads: int = 0
    linear_num_value_heads: int = 0
    linear_key_head_dim: int = 0
    linear_value_head_dim: int = 0
    linear_conv_kernel: int = 0
    mtp_layers: int = 0
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    extra: dict = field(default_factory=dict, compare=False)

    @property
    def is_hybrid(self) -> bool:
        return self.arch == "qwen3_5"

    def kinds(self) -> tuple[str, ...]:
        """The mixer of each layer: "full_attention" or "linear_attention"."""
        return self.layer_types or ("full_attention",) * self.num_layers
