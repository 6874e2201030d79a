"""The memory plan: what a model + engine config needs on the device and on the host, computed before anything
is allocated. The engine refuses to start when it does not fit; `ninfer profiles fit` shows the same numbers."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from .cache.kv_pool import pool_rows
from .config import EngineConfig
from .models.spec import ModelSpec
from .quant.formats import tensor_bytes
from .runtime.lanes import batch_buckets

GIB = 1 << 30
MIB = 1 << 20
# CUDA context, cuBLAS/Triton workspaces and allocator slack: measured ~0.45 GiB for torch + triton on an
# H200 and RTX-class cards; rounded up so a plan that "fits" leaves room for fragmentation.
CUDA_RUNTIME_BYTES = 768 * MIB
# Each captured CUDA graph keeps a small private pool beyond the static buffers counted in the workspace.
GRAPH_BYTES_PER_BUCKET = 32 * MIB
_DTYPE_BYTES = {"float64": 8, "float32": 4, "bfloat16": 2, "float16": 2}
_KV_ELEM = {"bf16": 2, "int8": 1, "fp8": 1}
KV_SCALE_BYTES = 4  # one fp32 scale per (token, head) for int8/fp8 KV
# Recurrent-state checkpoints a sequence keeps at the starts of its last messages (besides the prompt's end).
MESSAGE_CHECKPOINTS = 3
# where some parts of a fused weight stay in GGUF blocks, the others join them as F32 rows whatever the compute
# dtype (`gguf_blocks.concat`)
F32_BYTES = 4


def weight_class(name: str) -> str:
    """The WeightFormats class of a canonical weight name, or "other" (norms, conv, decay parameters)."""
    if name == "embed_tokens.weight":
        return "embed"
    if name == "lm_head.weight":
        return "lm_head"
    if ".self_attn." in name and name.endswith("_proj.weight"):
        return "attn"
    if ".linear_attn." in name and "_proj" in name:
        return "gdn"
    if ".mlp." in name:
        return "mlp"
    return "other"


@dataclass(frozen=True)
class MemoryPlan:
    device_type: str  # where the "device" rows live: "cuda" or "cpu" (then it is all host memory)
    weights: int
    kv_pool: int  # the paged pool: running requests' KV and the held conversations' (the next turns reuse them)
    state_slots: int
    spec_states: int
    drafter: int
    workspace: int
    graphs: int
    runtime: int
    host_kv: int
    host_states: int
    kv_tokens: int
    state_bytes_per_slot: int
    kv_dtype: str  # "auto" or "bf16" (the compute dtype), "int8" or "fp8"

    @property
    def device_total(self) -> int:
        return (self.weights + self.kv_pool + self.state_slots + self.spec_states + self.drafter
                + self.workspace + self.graphs + self.runtime)

    @property
    def host_total(self) -> int:
        return self.host_kv + self.host_states

    def rows(self) -> list[tuple[str, int, str]]:
        """(what, bytes, knob that changes it) for display."""
        return [
            ("weights", self.weights, "weights (format per tensor class)"),
            (f"KV pool ({self.kv_tokens} tokens, running + held)", self.kv_pool, "kv_capacity / max_context, kv_dtype"),
            ("recurrent-state slots", self.state_slots, "max_concurrency, held_sequences"),
            ("verify / prefill-piece inputs", self.spec_states, "spec, draft_tokens, graph_prefill_tokens"),
            ("drafter (weights + its KV)", self.drafter, "spec, drafter"),
            ("workspace (activations, logits)", self.workspace, "prefill_chunk"),
            ("CUDA graphs", self.graphs, "cuda_graphs"),
            ("runtime (CUDA context, allocator slack)", self.runtime, ""),
        ]

    def as_dict(self) -> dict:
        return {
            "device_type": self.device_type, "weights": self.weights, "kv_pool": self.kv_pool,
            "state_slots": self.state_slots, "spec_states": self.spec_states, "drafter": self.drafter,
            "workspace": self.workspace,
            "graphs": self.graphs, "runtime": self.runtime, "device_total": self.device_total,
            "host_kv": self.host_kv, "host_states": self.host_states, "host_total": self.host_total,
            "kv_tokens": self.kv_tokens,
        }


def compute_dtype_bytes(config: EngineConfig, device_type: str) -> int:
    if config.dtype == "auto":
        return 2 if device_type == "cuda" else 4
    return _DTYPE_BYTES[config.dtype]


def kv_bytes_per_token(spec: ModelSpec, kv_dtype: str, dtype_bytes: int, layers: int | None = None) -> int:
    """KV bytes one token takes over all full-attention layers, or over `layers` attention layers of the same
    geometry (K and V, plus scales for 8-bit formats)."""
    if layers is None:
        layers = sum(1 for k in spec.kinds() if k == "full_attention")
    elem = dtype_bytes if kv_dtype == "auto" else _KV_ELEM[kv_dtype]
    scales = KV_SCALE_BYTES if kv_dtype in ("int8", "fp8") else 0
    return layers * 2 * spec.num_kv_heads * (spec.head_dim * elem + scales)


def gdn_dims(spec: ModelSpec) -> tuple[int, int]:
    """(GDN layers, conv channels) of a model: the q, k and v columns its conv runs over."""
    layers = sum(1 for k in spec.kinds() if k == "linear_attention")
    conv_dim = 2 * spec.linear_num_key_heads * spec.linear_key_head_dim + \
        spec.linear_num_value_heads * spec.linear_value_head_dim
    return layers, conv_dim


def recurrent_state_bytes(spec: ModelSpec, dtype_bytes: int) -> tuple[int, int]:
    """(conv window, recurrent matrix) bytes of one sequence over all GDN layers (the matrix is kept in fp32)."""
    layers, conv_dim = gdn_dims(spec)
    if not layers:
        return 0, 0
    conv = layers * (spec.linear_conv_kernel - 1) * conv_dim * dtype_bytes
    rec = layers * spec.linear_num_value_heads * spec.linear_key_head_dim * spec.linear_value_head_dim * \
        max(4, dtype_bytes)
    return conv, rec


def verify_keep_bytes(spec: ModelSpec, t: int, dtype_bytes: int) -> int:
    """What a verify step of t tokens keeps of one sequence's GDN layers until its commit (`KeptInputs`): each
    token's conv output row and raw b, a, and the conv window (K-1+t rows); the recurrent state itself is replayed
    from them, not kept per token. 0 for t = 1 (no verify steps)."""
    layers, conv_dim = gdn_dims(spec)
    if t == 1 or not layers:
        return 0
    rows = t * (conv_dim + 2 * spec.linear_num_value_heads) + (spec.linear_conv_kernel - 1 + t) * conv_dim
    return layers * rows * dtype_bytes


def stored_weights(config: EngineConfig, device_type: str) -> dict[str, int]:
    """The bytes of each weight (by canonical name) that a GGUF model, or a folder converted from one, keeps in its
    blocks on a GPU, which the plan counts instead of the compute dtype's: none where the profile asks for weight
    formats (the load re-quantizes every tensor then), with tensor parallelism (each rank's pieces are counted from
    the shapes), or for another kind of model."""
    if device_type != "cuda" or config.tensor_parallel > 1 or \
            any(v != "auto" for v in config.weights.as_dict().values()):
        return {}
    path = Path(config.model).expanduser()
    from .loaders import model_kind

    kind = model_kind(str(path)) if path.exists() else ""
    if kind not in ("gguf", "converted"):
        return {}
    import torch

    from .loaders import converted, gguf

    return (gguf if kind == "gguf" else converted).kept_bytes(path, torch.device("cuda"))


def joins_blocks(name: str, stored: dict[str, int], fused: tuple[tuple[str, ...], ...]) -> bool:
    """Whether a weight that is not kept in blocks is fused (`fused`: the model's groups) with one that is."""
    for group in fused:
        part = next((p for p in group if name.endswith("." + p)), None)
        if part is not None:
            prefix = name[:-len(part)]
            return any(prefix + p in stored for p in group)
    return False


def weight_bytes(spec: ModelSpec, config: EngineConfig, dtype_bytes: int, shapes: dict | None = None,
                 stored: dict[str, int] | None = None) -> int:
    """`stored`: weights whose bytes are known as loaded (`stored_weights`), counted as they are; the others fused
    with them are F32 rows."""
    from .models import fused_weights, weight_shapes

    formats = config.weights.as_dict()
    fused = fused_weights(spec) if stored else ()
    total = 0
    for name, shape in (weight_shapes(spec) if shapes is None else shapes).items():
        numel = 1
        for d in shape:
            numel *= d
        cls = weight_class(name)
        if stored and name in stored:
            total += stored[name]
        elif stored and joins_blocks(name, stored, fused):
            total += numel * F32_BYTES
        elif cls == "other":
            total += numel * (max(4, dtype_bytes) if name.endswith(("A_log", "dt_bias")) else dtype_bytes)
        else:
            total += tensor_bytes(numel, formats[cls], dtype_bytes)
    return total


def drafter_bytes(spec: ModelSpec, config: EngineConfig, dtype_bytes: int, stored: dict[str, int] | None = None
                  ) -> int:
    """The drafter's weights and its own KV (one entry per token of the KV pool: the target's blocks index it). A
    DFlash folder that cannot be read counts 0 here: loading it fails with its own message. `stored`: as in
    `weight_bytes` (an MTP head's)."""
    tokens = pool_rows(config.kv_tokens)
    if config.spec == "mtp" and spec.is_hybrid:
        from .models.qwen3_5 import mtp_shapes

        kv = kv_bytes_per_token(spec, config.kv_dtype, dtype_bytes, layers=spec.mtp_layers)  # it takes the target's
        return weight_bytes(spec, config, dtype_bytes, mtp_shapes(spec), stored) + tokens * kv
    if config.spec != "dflash" or not config.drafter:
        return 0
    from .errors import UserError
    from .models.dflash import dflash_shapes, dflash_spec, drafter_config

    try:
        d = dflash_spec(drafter_config(config.drafter))
    except UserError:
        return 0
    total = 0
    for shape in dflash_shapes(d).values():
        numel = shape[0] * (shape[1] if len(shape) > 1 else 1)
        total += tensor_bytes(numel, config.drafter_weights if len(shape) == 2 else "auto", dtype_bytes)
    return total + tokens * d.num_layers * 2 * d.num_kv_heads * d.head_dim * dtype_bytes


def tower_patches(config: EngineConfig, patch_size: int) -> int:
    """The most patches one run of the vision tower takes: one image at image_max_pixels, or the frames of a video
    at video_max_pixels that fit beside one another (at least one frame: a longer video runs in several)."""
    return max(config.image_max_pixels, config.video_max_pixels) // patch_size ** 2


def plan_memory(spec: ModelSpec, config: EngineConfig, device_type: str) -> MemoryPlan:
    """What one process needs: with tensor parallelism, rank 0's, the largest (its heads' KV and state, its shard
    of the weights, the logits whole as every rank gathers them; and what runs on it alone: the drafter with the
    whole embedding and LM head it reads, the vision tower)."""
    shapes, whole = None, spec
    if config.tensor_parallel > 1:
        from .models import weight_shapes
        from .parallel.shards import DRAFTER_MODELS, check_split, local_spec, rank_shapes

        # a cut that cannot be has no plan
        check_split(spec, config.tensor_parallel, config.weights.as_dict(), config.model)
        shapes = rank_shapes(weight_shapes(spec), config.tensor_parallel)
        if config.spec in DRAFTER_MODELS:  # rank 0's shard of the vocabulary is a view of the whole rows
            full = weight_shapes(spec)
            shapes.update({name: full[name] for name in ("embed_tokens.weight", "lm_head.weight") if name in full})
        spec = local_spec(spec, config.tensor_parallel)
    dtype_bytes = compute_dtype_bytes(config, device_type)
    conv, rec = recurrent_state_bytes(spec, dtype_bytes)
    per_slot = conv + rec
    t = config.verify_tokens
    inner = max(2 * spec.intermediate_size,
                2 * spec.linear_num_key_heads * spec.linear_key_head_dim
                + 2 * spec.linear_num_value_heads * spec.linear_value_head_dim)
    # Per token of a prefill chunk: the widest projection output, the residual stream and q/k/v, double-buffered.
    act = config.prefill_chunk * (inner + 4 * spec.hidden_size + 2 * spec.num_heads * spec.head_dim) * dtype_bytes * 2
    cuda = device_type == "cuda"
    piece = 0  # a graphed prefill piece's tokens: its graph keeps GDN inputs and logits of its own per lane
    if cuda and config.cuda_graphs and config.graph_prefill_tokens:
        from .runtime.runner import PREFILL_PIECE

        piece = PREFILL_PIECE
        if piece == t:  # a verify step of PREFILL_PIECE tokens: the prefill pieces replay the verify graph
            piece = 0
    logits = config.max_concurrency * (t + piece) * spec.vocab_size * 4
    # a batch verify graph (several requests' verify steps at once) per batch bucket: its logits and each of its
    # lanes' kept GDN inputs
    verifies = sum(batch_buckets(config.graph_lanes)) if cuda and config.cuda_graphs and t > 1 else 0
    logits += verifies * t * spec.vocab_size * 4
    stored = stored_weights(config, device_type)
    if cuda and (config.weights.quantized() or stored):
        from .kernels.dequant import SCRATCH_ELEMENTS

        act += SCRATCH_ELEMENTS * dtype_bytes  # a prefill matmul's block of dequantized weight rows
    graphs = 0
    if cuda and config.cuda_graphs:  # each lane's decode (verify, prefill piece) step, the batch buckets' decode
        # (and verify) steps
        lanes = config.graph_lanes
        graphs = lanes * (1 + (t > 1) + (piece > 0)) + len(batch_buckets(lanes)) * (1 + (t > 1))
    tower = 0  # one run of the vision tower's activations, where requests may send images or videos
    if config.vision and whole.vision_params:
        tower = tower_patches(config, whole.vision_patch_size) * whole.vision_patch_elements * dtype_bytes
    return MemoryPlan(
        device_type=device_type,
        # the tower unquantized, loaded only where requests may send images or videos
        weights=weight_bytes(spec, config, dtype_bytes, shapes, stored)
        + whole.vision_params * dtype_bytes * config.vision,
        kv_pool=pool_rows(config.kv_tokens) * kv_bytes_per_token(spec, config.kv_dtype, dtype_bytes),
        # Each running sequence and each held conversation (reused by its next turn) keeps its state and its
        # checkpoints (the starts of its last messages and the end of its prompt); the held ones' go to host
        # memory with host_state_slots.
        state_slots=(2 + MESSAGE_CHECKPOINTS) * per_slot
        * (config.max_concurrency + (0 if config.host_state_slots else config.held_sequences)),
        # Verify steps and graphed prefill pieces keep each token's GDN inputs so that their commit can replay the
        # kept ones.
        spec_states=config.max_concurrency * (verify_keep_bytes(spec, t, dtype_bytes)
                                              + (verify_keep_bytes(spec, piece, dtype_bytes) if piece else 0))
        + verifies * verify_keep_bytes(spec, t, dtype_bytes),
        drafter=drafter_bytes(whole, config, dtype_bytes, stored),  # rank 0's, whole: all heads of the MTP layer's KV
        workspace=act + logits + tower,
        graphs=graphs * GRAPH_BYTES_PER_BUCKET,
        runtime=CUDA_RUNTIME_BYTES if cuda else 0,
        host_kv=config.host_kv_mib * MIB,
        host_states=config.host_state_slots * per_slot,
        kv_tokens=config.kv_tokens,
        state_bytes_per_slot=per_slot,
        kv_dtype=config.kv_dtype,
    )


@dataclass(frozen=True)
class FitVerdict:
    fits: bool
    need: int
    available: int
    advice: str

    def message(self) -> str:
        verb = "fits" if self.fits else "does not fit"
        return f"{verb}: needs {self.need / GIB:.2f} GiB of {self.available / GIB:.2f} GiB available"


def check_fit(plan: MemoryPlan, available: int) -> FitVerdict:
    """Whether the device part of the plan fits `available` bytes, and which knob to turn when it does not."""
    fits = plan.device_total <= available
    advice = ""
    if not fits:
        over = plan.device_total - available
        # Prefer a knob that closes the gap alone, KV first (the cheapest to give up), weights last.
        kv_knob = "lower max_context / kv_capacity"
        if plan.kv_dtype not in ("int8", "fp8"):  # 8-bit KV is the smallest there is: its next knob is the size
            kv_knob += ", or use kv_dtype int8 or fp8"
        parts = [("KV pool", plan.kv_pool, kv_knob),
                 ("verify / prefill-piece inputs", plan.spec_states, "lower draft_tokens, set spec = \"none\" or "
                  "graph_prefill_tokens = 0"),
                 ("recurrent-state slots", plan.state_slots, "lower max_concurrency or held_sequences"),
                 ("workspace", plan.workspace, "lower prefill_chunk"),
                 ("weights", plan.weights, "use smaller weight formats (weights = \"q4\", or q4/q5 per class)")]
        enough = [p for p in parts if p[1] >= over]
        name, size, knob = enough[0] if enough else max(parts, key=lambda p: p[1])
        advice = f"short by {over / GIB:.2f} GiB; {name} takes {size / GIB:.2f} GiB: {knob}"
    return FitVerdict(fits, plan.device_total, available, advice)
