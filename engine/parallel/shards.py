"""How a Qwen3.5/3.6 model's weights are cut over N ranks (tensor parallelism, Megatron's split): the rules as
data, one per weight name, and the cut itself, applied to each weight as it loads.

- Column-parallel (output rows cut): the q/k/v projections by heads (q_proj's rows are per head [query | gate],
  so the output gate goes with its head), the GDN input projections by key/value heads (in_proj_qkv and the
  conv over it in three blocks, q | k | v, each cut alike), z, b, a and the decay parameters by value heads, the
  MLP's gate/up by columns. A rank computes its heads whole: nothing to exchange.
- Row-parallel (input columns cut): the attention/GDN output projections and the MLP's down projection, which read
  the heads (columns) the rank computed; each rank's product is a partial sum, summed over the ranks (all-reduce).
- Vocabulary: the embedding and the LM head by rows (token ids); a lookup is summed over the ranks (one holds each
  id), the logits are gathered.
- Everything else is whole: the norms on every rank, the MTP head on rank 0 alone, which runs the drafters
  (`leader.py`).

Quantized weights are cut before they are quantized, each rank quantizing its own shard, and that is exact: the
format quantizes groups of GROUP weights along the input dimension, one scale per group and output row. A column
cut keeps whole rows, so each shard's groups, scales and codes are those of the whole weight's rows. A row cut
lands on a group boundary only where the shard's width (in_features / N) is a multiple of GROUP; then every group
lies on one rank and is quantized as in the whole weight. `check_split` refuses an N that breaks a quantized
row-parallel weight's groups.

A converted folder (`ninfer convert`) stores its weights quantized whole, and its loader applies no hook: each rank
loads them all (on the CPU, views of the mapped shards) and then copies out its pieces (`cut_loaded`), each stored
format cut on its own boundaries (`cut_packed`), to the very codes and scales the float weight's piece quantizes
to by the rule above. GGUF blocks (kept in a folder converted from a GGUF file) are cut alike: their
rows are stored apart, a row cut must fall on a block boundary.
"""
from __future__ import annotations

import math
import re
import shlex
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from ..errors import UserError
from ..models.spec import ModelSpec
from ..quant import qweight
from ..quant.gguf_blocks import BlockRows, GGUFWeight
from ..quant.qweight import GROUP, QuantizedWeight, tile, tileable, untile


@dataclass(frozen=True)
class Split:
    """How one weight is cut: along `dim` (0: output rows, 1: input columns) in N equal pieces, or each of the
    blocks `parts(spec)` gives (a fused layout) cut alike and a rank's pieces kept in order. `comm` is what its
    output needs: "" (whole heads or columns, read by the next cut weight), "sum" (partial sums: all-reduce),
    "vocab" (a slice of the vocabulary: lookups summed, logits gathered)."""

    dim: int
    comm: str = ""
    parts: Callable[[ModelSpec], tuple[int, ...]] | None = None


def gdn_channels(s: ModelSpec) -> tuple[int, ...]:
    """The blocks of the GDN input projection's rows (q | k | v): the conv's channels, and its state's."""
    key = s.linear_num_key_heads * s.linear_key_head_dim
    return key, key, s.linear_num_value_heads * s.linear_value_head_dim


COLUMNS = Split(0)
ROWS = Split(1, "sum")
VOCAB = Split(0, "vocab")

# canonical weight name (full match) -> its cut; a name matching none is whole on every rank
RULES: tuple[tuple[re.Pattern, Split], ...] = tuple((re.compile(pattern), split) for pattern, split in (
    (r"embed_tokens\.weight", VOCAB),
    (r"lm_head\.weight", VOCAB),
    (r"layers\.\d+\.self_attn\.[qkv]_proj\.weight", COLUMNS),
    (r"layers\.\d+\.self_attn\.o_proj\.weight", ROWS),
    (r"layers\.\d+\.linear_attn\.(in_proj_qkv|conv1d)\.weight", Split(0, parts=gdn_channels)),
    (r"layers\.\d+\.linear_attn\.in_proj_[zba]\.weight", COLUMNS),
    (r"layers\.\d+\.linear_attn\.(A_log|dt_bias)", COLUMNS),
    (r"layers\.\d+\.linear_attn\.out_proj\.weight", ROWS),
    (r"layers\.\d+\.mlp\.(gate|up)_proj\.weight", COLUMNS),
    (r"layers\.\d+\.mlp\.down_proj\.weight", ROWS),
))


def split_of(name: str) -> Split | None:
    """The cut of a canonical weight name; None: whole on every rank."""
    return next((split for pattern, split in RULES if pattern.fullmatch(name)), None)


def shard(name: str, w: torch.Tensor | QuantizedWeight | GGUFWeight, spec: ModelSpec, rank: int, world: int):
    """Rank `rank`'s piece of weight `name` (a copy: the whole weight's memory can go), or w itself when whole."""
    split = split_of(name)
    if split is None or world == 1:
        return w
    sizes = split.parts(spec) if split.parts is not None else None
    if isinstance(w, torch.Tensor):
        return cut(w, split.dim, rank, world, sizes)
    return cut_packed(w, split.dim, rank, world, sizes)


def cut(t: torch.Tensor, dim: int, rank: int, world: int, sizes: tuple[int, ...] | None = None) -> torch.Tensor:
    """Rank `rank`'s piece of t along `dim`: the rank-th of N equal pieces of each block `sizes` gives (a fused
    layout; None: t is one block), in order."""
    blocks = t.split(sizes, dim) if sizes is not None else (t,)
    return torch.cat([block.chunk(world, dim)[rank] for block in blocks], dim)


def cut_packed(w: QuantizedWeight | GGUFWeight, dim: int, rank: int, world: int,
               sizes: tuple[int, ...] | None = None) -> QuantizedWeight | GGUFWeight:
    """`cut` of a weight stored quantized: each stored tensor cut alike. Its rows are its codes', scales' and bit
    planes' rows (or a GGUF weight's rows, over its runs of one type); its input columns, whole groups (blocks) per
    rank (`check_split`), are proportionate columns of each of them. A tiled weight is cut row-major, then tiled
    again where its piece can be."""
    if isinstance(w, GGUFWeight):
        return _cut_blocks(w, dim, rank, world, sizes)
    q = untile(w)
    parts = [q.codes, q.scales] + ([] if q.high is None else [q.high])
    codes, scales, *high = [cut(t, dim, rank, world, sizes) for t in parts]
    rows, k = (q.out_features // world, q.in_features) if dim == 0 else (q.out_features, q.in_features // world)
    piece = replace(q, codes=codes, scales=scales, high=high[0] if high else None, out_features=rows, in_features=k)
    return tile(piece) if w.tiled and tileable(piece) else piece


def _cut_blocks(w: GGUFWeight, dim: int, rank: int, world: int, sizes: tuple[int, ...] | None) -> GGUFWeight:
    if dim == 1:  # each row's bytes are its blocks in order
        return GGUFWeight(tuple(BlockRows(p.qtype, cut(p.data, 1, rank, world)) for p in w.parts),
                          w.in_features // world, w.compute_dtype)
    ranges, begin = [], 0
    for size in sizes or (w.out_features,):
        ranges.append((begin + rank * size // world, begin + (rank + 1) * size // world))
        begin += size
    runs: list[BlockRows] = []  # copies, as `cut`'s; neighbours of one type joined (one kernel call), as loaded
    for p in block_rows(w, ranges).parts:
        if runs and runs[-1].qtype == p.qtype:
            runs[-1] = BlockRows(p.qtype, torch.cat([runs[-1].data, p.data]))
        else:
            runs.append(BlockRows(p.qtype, p.data.clone()))
    return GGUFWeight(tuple(runs), w.in_features, w.compute_dtype)


def block_rows(w: GGUFWeight, ranges: list[tuple[int, int]]) -> GGUFWeight:
    """The rows [begin, end) of each range, in order, of a GGUF weight: views of its runs of one type."""
    parts = []
    for begin, end in ranges:
        first = 0
        for p in w.parts:
            lo, hi = max(begin, first), min(end, first + p.rows)
            if lo < hi:
                parts.append(BlockRows(p.qtype, p.data[lo - first:hi - first]))
            first += p.rows
    return GGUFWeight(tuple(parts), w.in_features, w.compute_dtype)


def first_rows(w, n: int):
    """`quant.qweight.first_rows` (a view of the first `n` rows), GGUF weights too."""
    return block_rows(w, [(0, n)]) if isinstance(w, GGUFWeight) else qweight.first_rows(w, n)


def join(pieces: list[torch.Tensor], dim: int, sizes: tuple[int, ...] | None = None) -> torch.Tensor:
    """The whole t of the ranks' pieces, in rank order (`cut`'s inverse; `sizes`: the whole's blocks)."""
    if sizes is None:
        return torch.cat(pieces, dim)
    blocks = [p.split([size // len(pieces) for size in sizes], dim) for p in pieces]
    return torch.cat([piece[b] for b in range(len(sizes)) for piece in blocks], dim)


def shard_transform(spec: ModelSpec, rank: int, world: int, then=None, whole_vocab: bool = False):
    """The loaders' per-weight hook for one rank: its piece of each weight, then `then` (the quantizing hook of
    `quant.qweight.load_transform`, or None), so each rank quantizes only its own shard. With `whole_vocab` (rank
    0, where a drafter reads them) the embedding and the LM head load whole: rank 0's piece of each is their
    first rows, a view (`leader.Leader.model`)."""
    def transform(name: str, w: torch.Tensor):
        split = split_of(name)
        whole = whole_vocab and split is not None and split.comm == "vocab"
        piece = w if whole else shard(name, w, spec, rank, world)
        return then(name, piece) if then is not None else piece

    return transform


def converted(model: str) -> bool:
    """Whether the model is a converted folder (`ninfer convert`): its weights load whole, `cut_loaded` cuts them."""
    from ..loaders import model_kind

    return Path(model).expanduser().is_dir() and model_kind(model) == "converted"


def cut_loaded(weights: dict, spec: ModelSpec, rank: int, world: int, whole_vocab: bool = False) -> dict:
    """A converted folder's weights, loaded whole in their stored formats, cut as `shard_transform` cuts other
    models' as they load."""
    transform = shard_transform(spec, rank, world, whole_vocab=whole_vocab)
    return {name: transform(name, w) for name, w in weights.items()}


def local_spec(spec: ModelSpec, world: int) -> ModelSpec:
    """The geometry one rank's layers run: its share of the heads and of the MLP's columns. The vocabulary stays
    whole (the vocabulary shards look whole to the model: `parallel.layers.VocabShard`)."""
    return replace(spec, num_heads=spec.num_heads // world, num_kv_heads=spec.num_kv_heads // world,
                   linear_num_key_heads=spec.linear_num_key_heads // world,
                   linear_num_value_heads=spec.linear_num_value_heads // world,
                   intermediate_size=spec.intermediate_size // world)


# The drafters that read the target's embedding and LM head: with them rank 0 loads both whole.
DRAFTER_MODELS = ("mtp", "dflash")


def rank_shapes(shapes: dict[str, tuple[int, ...]], world: int) -> dict[str, tuple[int, ...]]:
    """The shapes of one rank's pieces (what it keeps in memory), from the whole weights' shapes."""
    out = {}
    for name, shape in shapes.items():
        split = split_of(name)
        if split is not None:
            shape = shape[:split.dim] + (shape[split.dim] // world,) + shape[split.dim + 1:]
        out[name] = shape
    return out


def check_split(spec: ModelSpec, world: int, formats: dict[str, str], model: str = "") -> None:
    """Refuse (one line, with the sizes that work) an N the model cannot be cut in: an architecture other than
    the Qwen3.5/3.6 hybrid, head counts or widths N does not divide, or a quantized row-parallel weight whose shard
    width is not a whole number of quantization groups. `formats`: the weight formats by class; `model`: where a
    converted folder, its stored weights are checked instead (their formats, GGUF blocks among them)."""
    if world == 1:
        return
    if spec.arch != "qwen3_5":
        raise UserError(f"tensor_parallel = {world}: only Qwen3.5/3.6 hybrid models run over several GPUs, this "
                        f"model is {spec.arch!r}", hint="set tensor_parallel = 1")
    counts = {"attention heads": spec.num_heads, "KV heads": spec.num_kv_heads,
              "GDN key heads": spec.linear_num_key_heads, "GDN value heads": spec.linear_num_value_heads,
              "MLP columns": spec.intermediate_size, "vocabulary rows": spec.vocab_size}
    for what, n in counts.items():
        if n % world:
            raise UserError(f"tensor_parallel = {world} does not divide the model's {n} {what}",
                            hint="use a tensor_parallel that divides " + ", ".join(f"{v} {k}" for k, v in
                                                                              counts.items()))
    if model and converted(model):
        _check_stored(Path(model).expanduser(), world)
        return
    widths = {"attn": spec.num_heads * spec.head_dim, "gdn": spec.linear_num_value_heads * spec.linear_value_head_dim,
              "mlp": spec.intermediate_size}
    for cls, width in widths.items():
        if formats.get(cls, "auto") not in ("auto", "bf16") and (width // world) % GROUP:
            raise UserError(f"tensor_parallel = {world} cuts the {cls} output projections ({width} inputs) into "
                            f"{width // world}-wide shards, not whole groups of {GROUP} for the {formats[cls]} "
                            "format", hint=f"use fewer ranks, or weights.{cls} = \"bf16\"")


def _check_stored(folder: Path, world: int) -> None:
    """Refuse an N that cuts a converted folder's stored row-parallel weight inside a quantization group or a GGUF
    block; the hint is the conversion that stores that class of weights in bf16."""
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    from ..loaders.manifest import read_manifest
    from ..memory_plan import weight_class

    m = read_manifest(folder)
    for name, e in m.tensors.items():
        split = split_of(name)
        if split is None or split.dim != 1 or e.format == "plain":
            continue
        if e.format == "gguf":
            types = [GGMLQuantizationType(q) for q in e.qtypes]
            block, what = math.lcm(*(GGML_QUANT_SIZES[t][0] for t in types)), "/".join(t.name for t in types)
        else:
            block, what = GROUP, e.format
        width = e.shape[1] // world
        if width % block:
            cls = weight_class(name)
            formats = {**m.weights, cls: "bf16"}
            again = " ".join(f"--set weights.{k}={v}" for k, v in formats.items())
            raise UserError(f"tensor_parallel = {world} cuts {name} ({e.shape[1]} inputs) into {width}-wide shards, "
                            f"not whole groups of {block} for its {what} format, as {folder} stores it",
                            hint=f"use fewer ranks, or convert it again with weights.{cls} = \"bf16\": ninfer "
                            f"convert {shlex.quote(m.source)} {shlex.quote(str(folder))} {again} --set "
                            f"dtype={m.dtype}{f' --mmproj {shlex.quote(m.mmproj)}' if m.mmproj else ''} --force")
