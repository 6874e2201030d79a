"""`ninfer show`: what a model says about itself (architecture, size, context, quantization, chat template,
license), read from a GGUF file's metadata or a HF folder's config.json and safetensors headers, never its weights."""
from __future__ import annotations

import math
import re
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from engine.errors import ModelFormatError, UserError

from .models import REGISTRY, display_name, entry_for, is_pulled, local_path, pull_hint
from .progress import size_text


@dataclass(frozen=True)
class ModelInfo:
    name: str
    path: str
    format: str  # "gguf", "safetensors" or "ninfer-converted-v<version>" (`ninfer convert`)
    size_bytes: int
    architecture: str
    parameters: int | None
    context_length: int | None
    embedding_length: int | None
    layers: int | None
    heads: int | None
    kv_heads: int | None
    vocab_size: int | None
    quantization: str | None
    chat_template: bool
    license: str | None

    def as_dict(self) -> dict:
        return asdict(self)

    def render(self) -> str:
        rows = [
            ("architecture", self.architecture), ("parameters", _count(self.parameters)),
            ("context length", self.context_length), ("embedding length", self.embedding_length),
            ("layers", self.layers), ("attention heads", _heads(self.heads, self.kv_heads)),
            ("vocabulary", self.vocab_size), ("quantization", self.quantization),
            ("chat template", "yes" if self.chat_template else "no (generate --prompt only; chat needs one)"),
            ("license", self.license or "unknown"), ("format", self.format),
            ("file", f"{self.path} ({size_text(self.size_bytes)})"),
        ]
        return "\n".join([self.name] + [f"  {k:17s} {v}" for k, v in rows if v is not None])


def _count(n: int | None) -> str | None:
    if n is None:
        return None
    for div, unit in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "K")):
        if n >= div:
            return f"{n / div:.1f}{unit} ({n:,})"
    return str(n)


def _heads(heads: int | None, kv_heads: int | None) -> str | None:
    if heads is None:
        return None
    return f"{heads}" + (f" ({kv_heads} for keys and values)" if kv_heads not in (None, heads) else "")


def model_path(ref: str) -> Path:
    """The file or folder a `show` argument names: a pulled registry model (never pulled here) or a path."""
    if ref in REGISTRY:
        entry = REGISTRY[ref]
        if not is_pulled(entry):
            raise UserError(f"model {ref} is not pulled, so there is nothing to read yet", hint=pull_hint(entry))
        return local_path(entry)
    path = Path(ref).expanduser()
    if not path.exists():
        entry_for(ref)  # an unknown name: the registry's error, with its suggestions
    return path


def describe(ref: str) -> ModelInfo:
    from engine.loaders import model_kind

    path = model_path(ref)
    kind = model_kind(str(path))
    info = {"folder": _folder_info, "converted": _converted_info}.get(kind, _gguf_info)
    return info(display_name(ref), path)


def _converted_info(name: str, folder: Path) -> ModelInfo:
    """A converted folder: its source's description (the copied config.json, or the GGUF metadata it keeps), with
    the folder's own size, parameters and formats."""
    from engine.loaders.manifest import GGUF_METADATA, VERSION, read_manifest

    m = read_manifest(folder)
    base = _folder_info(name, folder) if m.source_kind == "folder" else _gguf_info(name, folder / GGUF_METADATA)
    if any(v != "auto" for v in m.weights.values()):
        quant = m.formats_text()
    else:  # the source's own: a GGUF's blocks, or the compute dtype
        quant = base.quantization if m.source_kind == "gguf" else m.dtype
    return replace(base, path=str(folder), format=f"ninfer-converted-v{VERSION}",
                   size_bytes=sum(f.stat().st_size for f in folder.iterdir() if f.is_file()),
                   parameters=sum(math.prod(t.shape) for t in m.tensors.values()) or None, quantization=quant)


def _gguf_info(name: str, path: Path) -> ModelInfo:
    from gguf.constants import GGMLQuantizationType, LlamaFileType

    from engine.loaders.gguf_file import read_header

    header = read_header(path)
    meta = header.metadata
    arch = meta.get("general.architecture") or "unknown"
    file_type = meta.get("general.file_type")
    if file_type in LlamaFileType._value2member_map_:
        quant = LlamaFileType(file_type).name.removeprefix("MOSTLY_").removeprefix("ALL_")
    else:  # no file type recorded: the type that holds most of the weights
        by_type: dict[int, int] = {}
        for t in header.tensors:
            by_type[t.qtype] = by_type.get(t.qtype, 0) + math.prod(t.shape)
        top = max(by_type, key=by_type.get) if by_type else None
        quant = None if top is None else (GGMLQuantizationType(top).name
                                          if top in GGMLQuantizationType._value2member_map_ else f"type {top}")
    tokens = meta.get("tokenizer.ggml.tokens")
    return ModelInfo(
        name=name, path=str(path), format="gguf", size_bytes=path.stat().st_size, architecture=arch,
        parameters=sum(math.prod(t.shape) for t in header.tensors) or None,
        context_length=meta.get(f"{arch}.context_length"), embedding_length=meta.get(f"{arch}.embedding_length"),
        layers=meta.get(f"{arch}.block_count"), heads=meta.get(f"{arch}.attention.head_count"),
        kv_heads=meta.get(f"{arch}.attention.head_count_kv"),
        vocab_size=meta.get(f"{arch}.vocab_size", len(tokens) if tokens is not None else None),
        quantization=quant, chat_template=bool(meta.get("tokenizer.chat_template")),
        license=meta.get("general.license"),
    )


def _folder_info(name: str, folder: Path) -> ModelInfo:
    from engine.loaders import hf_config, read_json

    cfg = hf_config(folder)
    text = cfg.get("text_config") or cfg  # multimodal checkpoints keep the language model's numbers apart
    quant = (cfg.get("quantization_config") or {}).get("quant_method") or cfg.get("torch_dtype") or \
        cfg.get("dtype") or text.get("torch_dtype") or text.get("dtype")
    tok_cfg = folder / "tokenizer_config.json"
    template = (folder / "chat_template.jinja").is_file() or (folder / "chat_template.json").is_file() or \
        (tok_cfg.is_file() and bool(read_json(tok_cfg).get("chat_template")))
    return ModelInfo(
        name=name, path=str(folder), format="safetensors",
        size_bytes=sum(f.stat().st_size for f in folder.rglob("*") if f.is_file()),
        architecture=(cfg.get("architectures") or [cfg.get("model_type", "unknown")])[0],
        parameters=_safetensors_parameters(folder), context_length=text.get("max_position_embeddings"),
        embedding_length=text.get("hidden_size"), layers=text.get("num_hidden_layers"),
        heads=text.get("num_attention_heads"), kv_heads=text.get("num_key_value_heads"),
        vocab_size=text.get("vocab_size"), quantization=quant, chat_template=template, license=_card_license(folder),
    )


def _safetensors_parameters(folder: Path) -> int | None:
    """Elements of every tensor, from the shards' headers (the tensors are not read)."""
    from safetensors import safe_open

    total = 0
    shards = sorted(folder.glob("*.safetensors"))
    for shard in shards:
        try:
            with safe_open(str(shard), framework="numpy") as f:
                total += sum(math.prod(f.get_slice(k).get_shape()) for k in f.keys())
        except Exception as exc:  # safetensors raises its own SafetensorError for a damaged header
            raise ModelFormatError(f"{shard.name} is not a readable safetensors file: {exc}") from None
    return total if shards else None


def _card_license(folder: Path) -> str | None:
    """The `license:` of the model card's YAML front matter (how the Hub records it)."""
    card = folder / "README.md"
    if not card.is_file():
        return None
    m = re.match(r"---\n(.*?)\n---", card.read_text(encoding="utf-8", errors="replace"), re.S)
    lic = re.search(r"^license:\s*(\S.*?)\s*$", m.group(1), re.M) if m else None
    return lic.group(1).strip("'\"") if lic else None
