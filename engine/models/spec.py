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
    # M-RoPE (Qwen3.5's vision positions): rotary frequencies per axis (time, row, column), interleaved as
    # t h w t h w ...; a position then has three coordinates, equal for text tokens (plain RoPE)
    mrope_section: tuple[int, ...] = ()


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
    vision_params: int = 0  # the vision tower's parameters (a vision-language checkpoint), for the memory plan
    # the tower's activations per patch at its peak, in compute-dtype elements, and its patch side: the memory plan
    # counts one encode of the most patches a request's image or video frame may bring
    vision_patch_elements: int = 0
    vision_patch_size: int = 0
    extra: dict = field(default_factory=dict, compare=False)

    @property
    def is_hybrid(self) -> bool:
        return self.arch == "qwen3_5"

    def kinds(self) -> tuple[str, ...]:
        """The mixer of each layer: "full_attention" or "linear_attention"."""
        return self.layer_types or ("full_attention",) * self.num_layers


HF_ARCHS = {"llama": "llama", "qwen3_5": "qwen3_5", "qwen3_5_text": "qwen3_5"}


def spec_from_hf_config(cfg: dict) -> ModelSpec:
    """A ModelSpec from a HF config.json (llama, or Qwen3.5/3.6 with or without the multimodal wrapper)."""
    from ..errors import ModelFormatError

    model_type = cfg.get("model_type")
    if model_type not in HF_ARCHS:
        raise ModelFormatError(f"config.json: model_type {model_type!r} is not supported",
                               hint="supported model types: " + ", ".join(HF_ARCHS))
    arch = HF_ARCHS[model_type]
    text = cfg.get("text_config", cfg) if model_type == "qwen3_5" else cfg

    def need(key: str):
        if key not in text:
            raise ModelFormatError(f"config.json lacks {key!r}")
        return text[key]

    hidden, heads = int(need("hidden_size")), int(need("num_attention_heads"))
    head_dim = int(text.get("head_dim") or hidden // heads)
    rope_params = text.get("rope_parameters") or text.get("rope_scaling") or {}
    theta = float(rope_params.get("rope_theta", text.get("rope_theta", 10000.0)))
    partial = float(rope_params.get("partial_rotary_factor", text.get("partial_rotary_factor",
                                                                      0.25 if arch == "qwen3_5" else 1.0)))
    rope_type = rope_params.get("rope_type", rope_params.get("type", "default"))
    if rope_type not in ("default", "linear", "llama3"):
        raise ModelFormatError(f"config.json: RoPE type {rope_type!r} is not supported")
    rope = RopeSpec(
        theta=theta, rotary_dim=int(head_dim * partial), scaling_type=None if rope_type == "default" else rope_type,
        factor=float(rope_params.get("factor", 1.0)),
        low_freq_factor=float(rope_params.get("low_freq_factor", 1.0)),
        high_freq_factor=float(rope_params.get("high_freq_factor", 4.0)),
        original_max_position=int(rope_params.get("original_max_position_embeddings", 8192)),
        # transformers' qwen3_5 always recomposes the frequencies, with this default when the config has none
        mrope_section=tuple(rope_params.get("mrope_section", (11, 11, 10))) if arch == "qwen3_5" else (),
    )
    layers = int(need("num_hidden_layers"))
    layer_types: tuple[str, ...] = ()
    if arch == "qwen3_5":
        layer_types = tuple(text.get("layer_types") or (
            "linear_attention" if (i + 1) % int(text.get("full_attention_interval", 4)) else "full_attention"
            for i in range(layers)))
        if len(layer_types) != layers or set(layer_types) - {"linear_attention", "full_attention"}:
            raise ModelFormatError("config.json: layer_types must list 'linear_attention'/'full_attention' "
                                   f"for each of the {layers} layers")
    eos = text.get("eos_token_id", cfg.get("eos_token_id"))
    eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
    tie = cfg.get("tie_word_embeddings", text.get("tie_word_embeddings", arch == "llama"))
    return ModelSpec(
        arch=arch, vocab_size=int(need("vocab_size")), hidden_size=hidden, num_layers=layers, num_heads=heads,
        num_kv_heads=int(text.get("num_key_value_heads", heads)), head_dim=head_dim,
        intermediate_size=int(need("intermediate_size")), rms_eps=float(text.get("rms_norm_eps", 1e-6)),
        rope=rope, tie_embeddings=bool(tie), max_position=int(text.get("max_position_embeddings", 8192)),
        layer_types=layer_types, attn_output_gate=bool(text.get("attn_output_gate", arch == "qwen3_5")),
        linear_num_key_heads=int(text.get("linear_num_key_heads", 0)),
        linear_num_value_heads=int(text.get("linear_num_value_heads", 0)),
        linear_key_head_dim=int(text.get("linear_key_head_dim", 0)),
        linear_value_head_dim=int(text.get("linear_value_head_dim", 0)),
        linear_conv_kernel=int(text.get("linear_conv_kernel_dim", 0)),
        mtp_layers=int(text.get("mtp_num_hidden_layers", 0)),
        bos_token_id=text.get("bos_token_id", cfg.get("bos_token_id")), eos_token_ids=eos_ids,
        vision_params=vision_parameters(cfg["vision_config"]) if "vision_config" in cfg else 0,
        vision_patch_elements=vision_patch_elements(cfg["vision_config"]) if "vision_config" in cfg else 0,
        vision_patch_size=int(cfg["vision_config"].get("patch_size", 16)) if "vision_config" in cfg else 0,
    )


def vision_parameters(cfg: dict) -> int:
    """The parameters of a Qwen3.5/3.6 vision tower (`models/vision.py`) from its vision_config: the patch
    embedding, learned positions, the blocks (two LayerNorms, qkv, proj, a two-layer MLP, all with biases) and the
    merger (a LayerNorm and a two-layer MLP over a merge block's patches side by side)."""
    h, i, out = cfg["hidden_size"], cfg["intermediate_size"], cfg["out_hidden_size"]
    patch = cfg.get("in_channels", 3) * cfg.get("temporal_patch_size", 2) * cfg.get("patch_size", 16) ** 2
    block = 4 * h + (3 * h * h + 3 * h) + (h * h + h) + (i * h + i) + (h * i + h)
    merged = h * cfg.get("spatial_merge_size", 2) ** 2
    merger = 2 * h + (merged * merged + merged) + (out * merged + out)
    return (patch * h + h) + cfg.get("num_position_embeddings", 2304) * h + cfg["depth"] * block + merger


def vision_patch_elements(cfg: dict) -> int:
    """What the tower holds per patch at its peak, in compute-dtype elements: within a block the residual stream,
    its norm, q/k/v, the rotated q and k, the attention output and its projection (9 widths) and the MLP's two
    hidden rows; the pixel values and the rotary tables (fp32, two elements each)."""
    h, i = cfg["hidden_size"], cfg["intermediate_size"]
    patch = cfg.get("in_channels", 3) * cfg.get("temporal_patch_size", 2) * cfg.get("patch_size", 16) ** 2
    head = h // cfg["num_heads"]
    return 9 * h + 2 * i + 2 * (patch + 2 * head)
