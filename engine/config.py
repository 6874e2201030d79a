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
# a verify step feeds the drafts and the bonus token: 16 rows at most, what the decode-step kernels and the graphed
# prefill pieces take; drafters trained on 16-token blocks (DFlash) draft up to 15
MAX_DRAFT_TOKENS = 15
DRAFT_TOKENS = 7  # the default: more pays only where acceptance stays high deep into the round


def setting(default, help: str):
    """A dataclass field with its help text: flags and profile keys take their descriptions from here. A
    callable default is a factory."""
    if callable(default):
        return field(default_factory=default, metadata={"help": help})
    return field(default=default, metadata={"help": help})


def setting_help(name: str) -> str:
    """The help text of an EngineConfig field."""
    return next(f.metadata["help"] for f in fields(EngineConfig) if f.name == name)


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

    model: str = field(metadata={"help": "registry name, .gguf file, HF folder or synthetic:PRESET"})
    device: str = setting("auto", "where the model runs: auto picks cuda when a CUDA GPU is visible, else cpu")
    dtype: str = setting("auto", "compute dtype (auto: bf16 on a GPU, fp32 on the CPU)")
    weights: WeightFormats = setting(WeightFormats, "weight storage format of the projections: auto (the "
                                     "compute dtype), bf16, q8, q5 or q4")
    weight_layout: str = setting("auto", "q4/q5 storage: tiles (the CUDA matmuls, faster for verify steps), rows "
                                 "(the Triton ones, faster for one-token steps), auto = tiles when drafts are "
                                 "verified or steps batch")
    max_context: int = setting(8192, "longest prompt + completion of one request, in tokens")
    kv_capacity: int = setting(0, "tokens in the paged KV pool (running requests and held conversations); "
                               "0 = max_context x (max_concurrency + held_sequences)")
    kv_dtype: str = setting("auto", "KV cache precision (nothing below 8 bits); auto = the compute dtype")
    prefill_chunk: int = setting(512, "tokens one step runs: the running requests' tokens first, then prompt "
                                 "chunks in what is left (a longer prompt prefills over several steps)")
    graph_prefill_tokens: int = setting(128, "prefill chunks this short run as CUDA-graph steps of 16 tokens "
                                        "(a chat turn's new tokens); 0 = always eager")
    max_concurrency: int = setting(1, "requests decoded at once; more wait in the queue")
    max_pending_requests: int = setting(8, "requests that may wait for a slot before new ones are refused (429)")
    spec: str = setting("none", "speculative decoding drafter: none, mtp, dflash or ngram")
    draft_tokens: int = setting(DRAFT_TOKENS, f"guesses verified per step with spec (1..{MAX_DRAFT_TOKENS}; a DFlash "
                                "drafter up to its block size - 1)")
    drafter: str = setting("", "DFlash drafter checkpoint folder (spec dflash), or synthetic:PRESET")
    lm_head_draft: bool = setting(False, "draft through the target's LM head")
    draft_vocab: int = setting(0, "drafters guess among the first N token ids only (a smaller LM head per draft); "
                               "0 = the whole vocabulary")
    adaptive_drafts: bool = setting(True, "drafts per round follow each request's acceptance, and a step drafts only "
                                    "where drafting made more tokens per second at the current load; false: "
                                    "draft_tokens every round")
    draft_acceptance: float = setting(0.0, "benchmarks only: drafts are right at this rate (accepted / drafted, "
                                      "greedy), learned from the target's greedy output of an earlier identical "
                                      "request; the drafter still runs. 0 = the drafter's own guesses; no effect "
                                      "with spec none")
    host_kv_mib: int = setting(0, "host RAM (MiB) for held conversations' KV, which then leaves the GPU's KV pool "
                               "to the running requests; 0 = held in the pool")
    host_state_slots: int = setting(0, "recurrent-state copies of held conversations kept in host RAM; "
                                    "0 = on the GPU")
    held_disk_mib: int = setting(0, "disk space (MiB) for held conversations written to the state dir when they "
                                 "leave memory and at exit, found again by their tokens after a restart or a "
                                 "profile switch with the same model and formats; 0 = off")
    held_dir: str = setting("", "folder of the held conversations' files (the front end gives the state dir's; "
                            "empty = no disk tier)")
    cuda_graphs: bool = setting(True, "replay decode steps as captured CUDA graphs (GPU only)")
    held_sequences: int = setting(2, "finished conversations kept for reuse by their next turn (LRU)")
    kernel_cache: str = setting("", "JSON file of kernel tiles chosen by timing on this GPU (empty = choose at "
                                "every launch)")
    cpu_kernels_dir: str = setting("", "folder of the CPU kernels compiled at first use (the front end gives its "
                                   "cache dir's; empty = a temporary folder per process)")
    verified_shards: str = setting("", "JSON file recording the converted folders' shards whose SHA-256 was "
                                   "checked, so an unchanged shard is not hashed at every load (the front end "
                                   "gives its state dir's; empty = hash every shard at every load)")
    threads: int = setting(0, "CPU threads torch computes with (intra-op); 0 = torch's default, one per "
                           "physical core")
    mmproj: str = setting("", "vision projector of a GGUF model (llama.cpp's mmproj-*.gguf file); empty = the one "
                          "mmproj*.gguf beside the model file, if any (without one, the model reads no images)")
    image_max_pixels: int = setting(1 << 20, "pixels of one image after resizing (larger images shrink to it, "
                                    "~1 prompt token per 1,024 pixels on Qwen3.5/3.6)")
    image_max_mib: int = setting(20, "size of one image file a request may send (MiB)")
    max_images: int = setting(16, "images one request may send")
    video_max_frames: int = setting(64, "video frames one request may send, all its videos together: each video "
                                    "is sampled at its checkpoint's rate (2 per second on Qwen3.5/3.6), a longer "
                                    "one more sparsely; 0 = no videos")
    video_max_pixels: int = setting(768 * 32 * 32, "pixels of one video frame after resizing (larger frames shrink "
                                    "to it; two frames make one temporal patch, ~1 prompt token per 1,024 pixels)")
    video_max_mib: int = setting(64, "size of one video file a request may send (MiB)")
    video_decode_s: int = setting(60, "seconds one video's decoding may take before the request is refused (a decode "
                                  "holds one of the two slots every request's images and videos decode in)")
    tensor_parallel: int = setting(1, "GPUs one model is cut over (tensor parallelism: heads, MLP columns and the "
                                   "vocabulary split, one process per GPU started by ninfer; processes on the CPU "
                                   "with device cpu); 1 = one process")
    seed: int = setting(0, "seed of the engine's random state")
    extra: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        _choice("device", self.device, DEVICES)
        _choice("dtype", self.dtype, DTYPES)
        _choice("kv_dtype", self.kv_dtype, KV_DTYPES)
        _choice("spec", self.spec, SPEC_METHODS)
        _choice("weight_layout", self.weight_layout, WEIGHT_LAYOUTS)
        for name in ("max_context", "prefill_chunk", "max_concurrency", "tensor_parallel", "image_max_pixels",
                     "image_max_mib", "video_max_pixels", "video_max_mib", "video_decode_s"):
            if getattr(self, name) < 1:
                raise UserError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("max_pending_requests", "kv_capacity", "host_kv_mib", "host_state_slots", "held_disk_mib",
                     "held_sequences", "graph_prefill_tokens", "threads", "max_images", "video_max_frames"):
            if getattr(self, name) < 0:
                raise UserError(f"{name} must be >= 0, got {getattr(self, name)}")
        if not 1 <= self.draft_tokens <= MAX_DRAFT_TOKENS:
            raise UserError(f"draft_tokens must be in 1..{MAX_DRAFT_TOKENS}, got {self.draft_tokens}")
        if self.draft_vocab < 0 or self.draft_vocab % 64:
            raise UserError(f"draft_vocab must be 0 or a positive multiple of 64, got {self.draft_vocab}",
                            hint="e.g. 32768; 0 drafts over the whole vocabulary")
        if isinstance(self.draft_acceptance, bool) or not 0 <= self.draft_acceptance < 1:  # nan fails too
            raise UserError(f"draft_acceptance must be in [0, 1), got {self.draft_acceptance}",
                            hint="e.g. 0.596 (the reference DFlash K=7 run) or 0.79 (MTP3); 0 = the drafter's own")
        if 0 < self.kv_capacity < self.max_context:
            raise UserError(f"kv_capacity ({self.kv_capacity}) is smaller than max_context ({self.max_context}): "
                            "one full-length request would not fit", hint="raise kv_capacity or set it to 0 (auto)")

    @property
    def vision(self) -> bool:
        """Whether requests may send images or videos: the vision tower is loaded (and planned) only then."""
        return self.max_images > 0 or self.video_max_frames > 0

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
        into one step: there the tiled kernels read the weights faster than the row-major ones, while one-row steps
        are faster on row-major weights (docs/kernels.md)."""
        several = self.verify_tokens > 1 or self.max_concurrency > 1
        return self.weight_layout == "tiles" or (self.weight_layout == "auto" and several)

    @property
    def graph_lanes(self) -> int:
        """Sequences that run at once with CUDA graphs: one working cache (lane) each, its KV blocks taken from
        the pool per request, and with a drafter its drafter graphs too."""
        return self.max_concurrency

    @property
    def verify_tokens(self) -> int:
        """Tokens per sequence in one decode/verify step: 1, or the drafts plus the bonus token."""
        return 1 if self.spec == "none" else self.draft_tokens + 1


def _choice(name: str, value: str, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise UserError(f"{name} = {value!r} is not one of {', '.join(allowed)}")
