"""The vision tower of the Qwen3.5/3.6 family (the checkpoint's `model.visual.*`): image and video patches in,
one embedding per 2x2 block of patches out, at the text model's width, for the prompt's image/video pad tokens.

The shape, as transformers' `Qwen3_5VisionModel` computes it: each image or video is a grid of t x h x w patches
(t temporal patches of `temporal_patch_size` frames; an image is one, its frame repeated by the processor), each
patch's pixels flattened channels-first (what the processor emits). Patches come in spatial-merge-block order:
the m x m patches that the merger joins are adjacent. A patch embedding (a 3D convolution whose kernel is its
stride: one matmul), learned positions on a square grid resampled bilinearly to the image's h x w, 2D rotary
positions (half the rotary frequencies on the row index, half on the column), pre-norm blocks whose attention
sees one frame of one image at a time, and the merger (LayerNorm, m*m patches side by side, a GELU MLP).
The loaders read it with the text model (`load_model(..., vision=True)`; a GGUF model's from its projector file,
`loaders/gguf_mmproj.py`); `media/encoder.py` runs it.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..errors import ModelFormatError

_ACTS = {"gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"), "gelu": F.gelu, "silu": F.silu,
         "quick_gelu": lambda x: x * torch.sigmoid(1.702 * x)}


@dataclass(frozen=True)
class VisionSpec:
    depth: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    out_hidden_size: int
    patch_size: int = 16
    temporal_patch_size: int = 2
    spatial_merge_size: int = 2
    in_channels: int = 3
    num_position_embeddings: int = 2304
    hidden_act: str = "gelu_pytorch_tanh"
    rope_theta: float = 10000.0
    eps: float = 1e-6  # the LayerNorms' (transformers' tower fixes it; a GGUF projector file states it)

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def patch_dim(self) -> int:
        """Pixel values per patch: channels x frames x rows x columns."""
        return self.in_channels * self.temporal_patch_size * self.patch_size ** 2


def vision_spec(cfg: dict) -> VisionSpec:
    """The tower's shape from a checkpoint config's `vision_config`."""
    try:
        spec = VisionSpec(depth=cfg["depth"], hidden_size=cfg["hidden_size"],
                          intermediate_size=cfg["intermediate_size"], num_heads=cfg["num_heads"],
                          out_hidden_size=cfg["out_hidden_size"], patch_size=cfg.get("patch_size", 16),
                          temporal_patch_size=cfg.get("temporal_patch_size", 2),
                          spatial_merge_size=cfg.get("spatial_merge_size", 2),
                          in_channels=cfg.get("in_channels", 3),
                          num_position_embeddings=cfg.get("num_position_embeddings", 2304),
                          hidden_act=cfg.get("hidden_act", "gelu_pytorch_tanh"),
                          rope_theta=(cfg.get("rope_parameters") or {}).get("rope_theta", 10000.0))
    except KeyError as exc:
        raise ModelFormatError(f"the vision config lacks {exc.args[0]!r}") from None
    if spec.hidden_act not in _ACTS:
        raise ModelFormatError(f"vision activation {spec.hidden_act!r} is not supported")
    if int(spec.num_position_embeddings ** 0.5) ** 2 != spec.num_position_embeddings:
        raise ModelFormatError("the vision tower's learned positions must form a square grid")
    return spec


class VisionTower:
    """The tower over a checkpoint's `visual.` tensors (names without that prefix), in their dtype."""

    def __init__(self, spec: VisionSpec, weights: dict[str, torch.Tensor]) -> None:
        self.spec, self.w = spec, weights
        missing = [n for n in tower_shapes(spec) if n not in weights]
        if missing:
            raise ModelFormatError(f"the vision tower lacks {len(missing)} tensors, e.g. {missing[0]!r}")
        proj = weights["patch_embed.proj.weight"]
        self.patch = proj.reshape(proj.shape[0], -1)  # the strided 3D convolution as one matmul
        side = int(spec.num_position_embeddings ** 0.5)
        self.pos_grid = weights["pos_embed.weight"].T.reshape(1, spec.hidden_size, side, side)
        spatial = spec.head_dim // 2  # rotary dims per axis: a quarter of the frequencies each
        self.inv_freq = 1.0 / spec.rope_theta ** (torch.arange(0, spatial, 2, dtype=torch.float32) / spatial)

    def __call__(self, pixels: torch.Tensor, grids: list[tuple[int, int, int]]) -> torch.Tensor:
        """pixels [patches, patch_dim] of the images/videos whose (t, h, w) patch grids are `grids`, in order ->
        [patches / m^2, out_hidden_size]: the embeddings of their pad tokens."""
        s, w = self.spec, self.w
        if pixels.shape != (sum(t * h * ww for t, h, ww in grids), s.patch_dim):
            raise ValueError(f"pixel values {tuple(pixels.shape)} do not match the grids {grids}")
        x = F.linear(pixels.to(self.patch.dtype), self.patch, w["patch_embed.proj.bias"])
        x = x + torch.cat([self._positions(t, h, ww) for t, h, ww in grids]).to(x.dtype)
        cos, sin = self._rotary(grids, x.device)
        frames = [h * ww for t, h, ww in grids for _ in range(t)]  # attention runs within one frame
        for i in range(s.depth):
            p = f"blocks.{i}."
            a = F.layer_norm(x, (s.hidden_size,), w[p + "norm1.weight"], w[p + "norm1.bias"], s.eps)
            x = x + self._attention(a, p, cos, sin, frames)
            m = F.layer_norm(x, (s.hidden_size,), w[p + "norm2.weight"], w[p + "norm2.bias"], s.eps)
            m = _ACTS[s.hidden_act](F.linear(m, w[p + "mlp.linear_fc1.weight"], w[p + "mlp.linear_fc1.bias"]))
            x = x + F.linear(m, w[p + "mlp.linear_fc2.weight"], w[p + "mlp.linear_fc2.bias"])
        x = F.layer_norm(x, (s.hidden_size,), w["merger.norm.weight"], w["merger.norm.bias"], s.eps)
        x = x.reshape(-1, s.hidden_size * s.spatial_merge_size ** 2)  # a merge block's patches side by side
        x = F.gelu(F.linear(x, w["merger.linear_fc1.weight"], w["merger.linear_fc1.bias"]))
        return F.linear(x, w["merger.linear_fc2.weight"], w["merger.linear_fc2.bias"])

    def _positions(self, t: int, h: int, w: int) -> torch.Tensor:
        """The learned positions resampled to h x w (bilinear, corners aligned), in merge-block order, per frame."""
        grid = F.interpolate(self.pos_grid.float(), size=(h, w), mode="bilinear", align_corners=True)[0]
        return _merge_order(grid.permute(1, 2, 0), self.spec.spatial_merge_size).repeat(t, 1)

    def _rotary(self, grids: list[tuple[int, int, int]], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [patches, head_dim]: a patch's row index turns the first quarter of the frequencies, its column
        the second, and the halves of the head repeat them (rotate-half pairs)."""
        rows, cols = [], []
        for t, h, w in grids:
            r, c = torch.meshgrid(torch.arange(h), torch.arange(w), indexing="ij")
            m = self.spec.spatial_merge_size
            rows.append(_merge_order(r[..., None], m).flatten().repeat(t))
            cols.append(_merge_order(c[..., None], m).flatten().repeat(t))
        angles = torch.cat([torch.cat(rows)[:, None] * self.inv_freq, torch.cat(cols)[:, None] * self.inv_freq], -1)
        angles = torch.cat([angles, angles], -1).to(device)
        return angles.cos(), angles.sin()

    def _attention(self, x: torch.Tensor, p: str, cos: torch.Tensor, sin: torch.Tensor,
                   frames: list[int]) -> torch.Tensor:
        s, w = self.spec, self.w
        n = x.shape[0]
        q, k, v = F.linear(x, w[p + "attn.qkv.weight"], w[p + "attn.qkv.bias"]).view(n, 3, s.num_heads,
                                                                                      s.head_dim).unbind(1)
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        # [1, heads, patches, head_dim]: SDPA takes its fused (flash / memory-efficient) kernels for 4D inputs only;
        # 3D ones fall to the math path, which holds the whole [heads, patches, patches] score matrix
        outs = [F.scaled_dot_product_attention(qf.transpose(0, 1)[None], kf.transpose(0, 1)[None],
                                               vf.transpose(0, 1)[None])[0].transpose(0, 1)
                for qf, kf, vf in zip(q.split(frames), k.split(frames), v.split(frames), strict=True)]
        return F.linear(torch.cat(outs).reshape(n, -1), w[p + "attn.proj.weight"], w[p + "attn.proj.bias"])


def _merge_order(grid: torch.Tensor, m: int) -> torch.Tensor:
    """[h, w, d] -> [h * w, d] with each m x m block's patches adjacent (block row, block column, row, column)."""
    h, w, d = grid.shape
    return grid.reshape(h // m, m, w // m, m, d).permute(0, 2, 1, 3, 4).reshape(h * w, d)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary positions on x [n, heads, head_dim] in fp32 (rotate-half pairs), back in x's dtype."""
    xf = x.float()
    half = xf.shape[-1] // 2
    turned = torch.cat([-xf[..., half:], xf[..., :half]], -1)
    return (xf * cos[:, None] + turned * sin[:, None]).to(x.dtype)


def tower_shapes(spec: VisionSpec) -> dict[str, tuple[int, ...]]:
    """The tower's tensors (names without `visual.`) and their shapes, as a checkpoint stores them."""
    h, i, m2 = spec.hidden_size, spec.intermediate_size, spec.hidden_size * spec.spatial_merge_size ** 2
    shapes = {"patch_embed.proj.weight": (h, spec.in_channels, spec.temporal_patch_size, spec.patch_size,
                                          spec.patch_size),
              "patch_embed.proj.bias": (h,), "pos_embed.weight": (spec.num_position_embeddings, h),
              "merger.norm.weight": (h,), "merger.norm.bias": (h,), "merger.linear_fc1.weight": (m2, m2),
              "merger.linear_fc1.bias": (m2,), "merger.linear_fc2.weight": (spec.out_hidden_size, m2),
              "merger.linear_fc2.bias": (spec.out_hidden_size,)}
    for b in range(spec.depth):
        for name, rows, cols in (("norm1", h, 0), ("norm2", h, 0), ("attn.qkv", 3 * h, h), ("attn.proj", h, h),
                                 ("mlp.linear_fc1", i, h), ("mlp.linear_fc2", h, i)):
            shapes[f"blocks.{b}.{name}.weight"] = (rows, cols) if cols else (rows,)
            shapes[f"blocks.{b}.{name}.bias"] = (rows,)
    return shapes
