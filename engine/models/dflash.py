"""DFlash block drafter (z-lab/dflash `DFlashDraftModel`): Qwen3-style layers that denoise a block of
[last token, mask x (B-1)] in one forward, conditioned on target hidden states.

Context: the outputs of a few tapped target layers, side by side, projected by `fc` and normed by
`hidden_norm`; every draft layer projects that same context into its own K/V, cached per sequence and cut back
to the accepted length. Queries come from the block only; keys/values are [context ; block]; full layers are
non-causal, sliding-window layers causal (the reference's default). No embedding or LM head of its own: the
target's embedding, and the target's LM head unless the checkpoint has one and `lm_head_draft` is off.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from ..cache.kv_pool import StoreSpec
from ..cache.sequence import SequenceCache
from ..cuda_graphs import MAX_GRAPH_TOKENS, BoundGraphs
from ..errors import ModelFormatError
from ..kernels.actquant import QuantRows
from ..kernels.attention import decode_attention
from ..transfer import to_device
from .layers import Rope, add_rms_norm, embed, fuse, linear, norm_rope, norm_rope_pair, rms_norm, swiglu
from .rows import row_argmax
from .spec import RopeSpec
from .taps import Taps


@dataclass(frozen=True)
class DFlashSpec:
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_eps: float
    rope_theta: float
    causal: tuple[bool, ...]  # per layer
    window: tuple[int | None, ...]  # per layer: the sliding window, or None for full attention
    target_layer_ids: tuple[int, ...]
    mask_token_id: int
    block_size: int
    vocab_size: int | None


def dflash_spec(cfg: dict) -> DFlashSpec:
    extra = cfg.get("dflash_config") or {}

    def need(key: str, where: dict = cfg):
        if key not in where:
            raise ModelFormatError(f"DFlash drafter config lacks {key!r}")
        return where[key]

    layers = int(need("num_hidden_layers"))
    types = list(cfg.get("layer_types") or ["full_attention"] * layers)
    if len(types) != layers:
        raise ModelFormatError(f"DFlash drafter config: layer_types lists {len(types)} layers, not {layers}")
    forced = cfg.get("is_causal")
    hidden, heads = int(need("hidden_size")), int(need("num_attention_heads"))
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    taps = extra.get("target_layer_ids", cfg.get("target_layer_ids"))
    mask = extra.get("mask_token_id", cfg.get("mask_token_id"))
    if taps is None or mask is None:
        raise ModelFormatError("DFlash drafter config lacks dflash_config.target_layer_ids / mask_token_id",
                               hint="give the folder of a DFlash drafter checkpoint (e.g. z-lab/Qwen3.6-27B-DFlash)")
    return DFlashSpec(
        hidden_size=hidden, num_layers=layers, num_heads=heads,
        num_kv_heads=int(cfg.get("num_key_value_heads", heads)), head_dim=int(cfg.get("head_dim") or hidden // heads),
        intermediate_size=int(need("intermediate_size")), rms_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        rope_theta=float(rope.get("rope_theta", cfg.get("rope_theta", 10000.0))),
        causal=tuple(t == "sliding_attention" if forced is None else bool(forced) for t in types),
        window=tuple(int(cfg["sliding_window"]) if t == "sliding_attention" else None for t in types),
        target_layer_ids=tuple(int(i) for i in taps), mask_token_id=int(mask),
        block_size=int(extra.get("block_size", cfg.get("block_size", 16))),
        vocab_size=int(cfg["vocab_size"]) if "vocab_size" in cfg else None)


def dflash_shapes(d: DFlashSpec) -> dict[str, tuple[int, ...]]:
    h, q, kv = d.hidden_size, d.num_heads * d.head_dim, d.num_kv_heads * d.head_dim
    shapes = {"fc.weight": (h, len(d.target_layer_ids) * h), "hidden_norm.weight": (h,), "norm.weight": (h,)}
    for i in range(d.num_layers):
        p = f"layers.{i}."
        shapes.update({p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
                       p + "self_attn.q_proj.weight": (q, h), p + "self_attn.k_proj.weight": (kv, h),
                       p + "self_attn.v_proj.weight": (kv, h), p + "self_attn.o_proj.weight": (h, q),
                       p + "self_attn.q_norm.weight": (d.head_dim,), p + "self_attn.k_norm.weight": (d.head_dim,),
                       p + "mlp.gate_proj.weight": (d.intermediate_size, h),
                       p + "mlp.up_proj.weight": (d.intermediate_size, h),
                       p + "mlp.down_proj.weight": (h, d.intermediate_size)})
    return shapes


def drafter_config(ref: str) -> dict:
    """The config of a drafter reference: `synthetic:PRESET`, or a checkpoint folder's config.json."""
    from ..errors import UserError
    from .presets import DRAFTER_PRESETS

    if ref.startswith("synthetic:"):
        preset = ref.split(":", 1)[1]
        if preset not in DRAFTER_PRESETS:
            raise UserError(f"unknown synthetic drafter {preset!r}", hint="presets: " + ", ".join(DRAFTER_PRESETS))
        return DRAFTER_PRESETS[preset]
    folder = Path(ref).expanduser()
    if not folder.is_dir():
        raise UserError(f"drafter path {str(folder)!r} is not a folder",
                        hint="set drafter to a DFlash checkpoint folder (config.json + *.safetensors)")
    path = folder / "config.json"
    if not path.is_file():
        raise ModelFormatError(f"drafter folder {str(folder)!r} has no config.json",
                               hint="set drafter to a DFlash checkpoint folder")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ModelFormatError(f"{path} is not valid JSON: {exc}") from None


def check_fits(d: DFlashSpec, t) -> None:
    """Refuse a drafter made for another target (before its weights load), naming both shapes."""
    problems = []
    if d.hidden_size != t.hidden_size:
        problems.append(f"hidden size {d.hidden_size} vs the target's {t.hidden_size}")
    if d.vocab_size is not None and d.vocab_size != t.vocab_size:
        problems.append(f"vocabulary {d.vocab_size} vs the target's {t.vocab_size}")
    if max(d.target_layer_ids) >= t.num_layers:
        problems.append(f"taps layer {max(d.target_layer_ids)} of a target with {t.num_layers} layers")
    if not 0 <= d.mask_token_id < t.vocab_size:
        problems.append(f"mask token {d.mask_token_id} outside the target's vocabulary of {t.vocab_size}")
    if problems:
        raise ModelFormatError("the DFlash drafter does not fit the target model: " + "; ".join(problems),
                               hint="use the drafter trained for this target model")


class DFlashDrafter:
    def __init__(self, d: DFlashSpec, weights: dict[str, torch.Tensor], target, own_head: bool = False,
                 graphs: bool = False) -> None:
        """`graphs`: on a GPU, replay the block forward and each round's context write as CUDA graphs (eager,
        their ~300 small launches cost more host time than the GPU spends on them)."""
        check_fits(d, target.geometry)
        for name, shape in dflash_shapes(d).items():
            if name not in weights:
                raise ModelFormatError(f"DFlash drafter weights lack tensor {name!r}")
            if tuple(weights[name].shape) != shape:
                raise ModelFormatError(f"DFlash drafter tensor {name!r} has shape {tuple(weights[name].shape)}, "
                                       f"its config implies {shape}")
        self.d, self.target, self.w = d, target, dict(weights)
        for i in range(d.num_layers):  # projections that read the same input: one matmul each
            p = f"layers.{i}."
            fuse(self.w, (p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"), p + "mlp.gate_up")
            fuse(self.w, (p + "self_attn.k_proj.weight", p + "self_attn.v_proj.weight"), p + "self_attn.kv")
        self.head = weights["lm_head.weight"] if own_head and "lm_head.weight" in weights else target.lm_head
        self.rope = Rope(RopeSpec(theta=d.rope_theta), d.head_dim, target.device)
        self.scale = d.head_dim ** -0.5
        # the attention kernel takes causal layers (with or without a window) and non-causal full ones
        fits = all(c or w is None for c, w in zip(d.causal, d.window, strict=True))
        self.graphs = BoundGraphs() if graphs and fits and target.device.type == "cuda" else None
        # the context K/V per target token, in the target's pool: the sequence's blocks index them too
        self.kv_store = ("dflash", StoreSpec(d.num_layers, d.num_kv_heads, d.head_dim, "auto", target.dtype))

    def taps(self) -> Taps:
        return Taps(layer_ids=self.d.target_layer_ids)

    def prepare(self, cache: SequenceCache) -> None:
        kv = cache.kv.view(*self.kv_store)
        if cache.draft is None:  # from the sequence's length: a shared prefix's context rows are in its blocks
            cache.draft = SequenceCache(kv=kv, length=cache.length)
        cache.draft.kv = kv
        cache.draft.length = min(cache.draft.length, cache.length)

    def _kv(self, i: int, x: torch.Tensor | QuantRows) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer i's K (before its norm and RoPE) and V of x [T, hidden], in one matmul."""
        d = self.d
        kv = linear(x, self.w[f"layers.{i}.self_attn.kv"]).view(-1, 2, d.num_kv_heads, d.head_dim)
        return kv[:, 0], kv[:, 1]

    def observe(self, cache: SequenceCache, ids: list[int], taps: Taps | None, next_token: int) -> None:
        seq = cache.draft
        start, n = seq.length, len(ids)
        positions = torch.arange(start, start + n, device=self.target.device)
        if self.graphs is not None and n <= MAX_GRAPH_TOKENS:  # a round's accepted tokens; prefill: eager
            self.graphs.replay(("observe", n), seq.kv.table.tensor, lambda f, p: self._write_context(seq, f, p),
                               taps.features(), positions)
        else:
            self._write_context(seq, taps.features(), positions)
        seq.length = start + n

    def _write_context(self, seq: SequenceCache, features: torch.Tensor, positions: torch.Tensor) -> tuple:
        """The context K/V of each layer from the tapped target features, at `positions`."""
        d = self.d
        # the norm also writes the int8 rows every layer's K/V matmul reads
        ctx = rms_norm(linear(features, self.w["fc.weight"]), self.w["hidden_norm.weight"], d.rms_eps,
                       feeds=self.w["layers.0.self_attn.kv"])
        cos, sin = self.rope.cos_sin(positions, self.target.dtype)
        for i in range(d.num_layers):
            k, v = self._kv(i, ctx)
            seq.kv.write(i, positions, norm_rope(k, self.w[f"layers.{i}.self_attn.k_norm.weight"], d.rms_eps, self.rope,
                                                 cos, sin), v)
        return ()

    def propose(self, cache: SequenceCache, history: list[int], k: int) -> torch.Tensor:
        return self.propose_rows([cache], [history], [k])[0]

    def propose_rows(self, caches: list[SequenceCache], histories: list[list[int] | None],
                     ks: list[int]) -> list[torch.Tensor]:
        """Each sequence's guesses (`propose`), all blocks in one forward: the matmuls read the weights once for
        every sequence. A None history is a lane that only pads a captured batch (a free lane, whose table maps
        to the scratch block): it drafts nothing. With graphs, a replay per set of tables and draft count (one
        sequence: its lane's own graphs)."""
        d, t = self.d, self.target
        k = max(ks)
        b = max(d.block_size, k + 1)
        starts = [c.draft.length if h is not None else 0 for c, h in zip(caches, histories, strict=True)]
        # the blocks' tokens and positions in one copy to the device (one launch, one staging buffer a round)
        both = to_device([tok for h in histories for tok in ([h[-1] if h is not None else 0]
                                                             + [d.mask_token_id] * (b - 1))]
                         + [s + j for s in starts for j in range(b)], t.device)
        block, pos = both[:len(both) // 2], both[len(both) // 2:]
        kvs = [c.draft.kv if h is not None else c.kv.view(*self.kv_store)
               for c, h in zip(caches, histories, strict=True)]
        if self.graphs is not None and all(s + b <= kv.table.span for s, kv in zip(starts, kvs, strict=True)):
            key = ("propose", k) if len(caches) == 1 else ("propose", k, *(id(kv.table.tensor) for kv in kvs))
            guesses = self.graphs.replay(key, kvs[0].table.tensor, lambda i, p: self._block(kvs, i, p, k),
                                         block, pos)[0]
        else:
            guesses = self._block(kvs, block, pos, k, eager_starts=starts)[0]
        guesses = guesses.view(len(caches), k)
        return [guesses[i, :n] for i, n in enumerate(ks)]

    def _block(self, kvs: list, block: torch.Tensor, pos: torch.Tensor, k: int,
               eager_starts: list[int] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The block forward of several sequences (one block of b rows each, over each one's drafter KV `kvs`):
        guesses (and their logits) for the k positions after each pending token, [n * k]. With `eager_starts`
        (the context lengths, on the host) each block's attention reads its cached context plus the block's own
        K/V; without, each block's K/V are written into its cache after the context (where the next context
        writes land) and the attention kernel reads them there, all on the device: what a captured graph
        replays."""
        d, t = self.d, self.target
        n = len(kvs)
        b = block.shape[0] // n
        x = embed(block, t.embed)
        cos, sin = self.rope.cos_sin(pos, x.dtype)
        h = None  # the last block's output, added to x by the next norm
        for i in range(d.num_layers):
            p = f"layers.{i}."
            # the norm's int8 rows serve both matmuls that read it (q, and k|v)
            x, a = add_rms_norm(x, h, self.w[p + "input_layernorm.weight"], d.rms_eps,
                                feeds=self.w[p + "self_attn.q_proj.weight"])
            q = linear(a, self.w[p + "self_attn.q_proj.weight"]).view(n * b, d.num_heads, d.head_dim)
            kb, vb = self._kv(i, a)
            q, kb = norm_rope_pair(q, kb, self.w[p + "self_attn.q_norm.weight"], self.w[p + "self_attn.k_norm.weight"],
                                   d.rms_eps, self.rope, cos, sin)
            outs = []
            for j, kv in enumerate(kvs):
                r = slice(j * b, (j + 1) * b)
                if eager_starts is None:
                    kv.write(i, pos[r], kb[r], vb[r])
                    # non-causal: every row sees the whole block
                    seen = pos[r] if d.causal[i] else pos[r][-1:].expand(b).contiguous()
                    outs.append(decode_attention(q[r], kv, i, seen, self.scale, window=d.window[i]))
                else:
                    start, win = eager_starts[j], d.window[i]
                    first = 0 if win is None else max(0, start - win)  # older context is never visible
                    kc, vc = kv.read(i, start)
                    keys, values = torch.cat([kc[first:], kb[r]]), torch.cat([vc[first:], vb[r]])
                    outs.append(_block_attention(q[r], keys, values, pos[r], first, d.causal[i], win, self.scale))
            out = outs[0] if n == 1 else torch.cat(outs)
            x, m = add_rms_norm(x, linear(out.reshape(n * b, -1), self.w[p + "self_attn.o_proj.weight"]),
                                self.w[p + "post_attention_layernorm.weight"], d.rms_eps,
                                feeds=self.w[p + "mlp.gate_up"])
            h = swiglu(m, self.w[p + "mlp.gate_up"], self.w[p + "mlp.down_proj.weight"])
        x = (x + h).view(n, b, -1)[:, 1:k + 1].reshape(n * k, -1)
        logits = linear(rms_norm(x, self.w["norm.weight"], d.rms_eps, feeds=self.head), self.head)
        return row_argmax(logits), logits


def _block_attention(q, keys, values, pos, first: int, causal: bool, window: int | None, scale: float):
    """q: [B, H, D] at positions `pos`; keys/values: [L, Hkv, D] at positions first..first+L-1."""
    key_pos = torch.arange(first, first + keys.shape[0], device=q.device)
    delta = pos[:, None] - key_pos[None, :]  # query position - key position
    visible = torch.ones_like(delta, dtype=torch.bool)
    if causal:
        visible &= delta >= 0
    if window is not None:
        visible &= (delta < window) & (-delta < window)
    out = F.scaled_dot_product_attention(q.transpose(0, 1)[None], keys.transpose(0, 1)[None],
                                         values.transpose(0, 1)[None], attn_mask=visible, scale=scale,
                                         enable_gqa=True)
    return out[0].transpose(0, 1)
