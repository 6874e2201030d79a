"""Tokenizer and chat template of a HF model folder."""
from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Tokenizer as _HFTokenizer

from ..errors import ModelFormatError
from ..models.spec import ModelSpec
from . import Tokenizer

BUILTIN_TEMPLATES = Path(__file__).parent / "templates"


def _token_text(value) -> str | None:
    return value.get("content") if isinstance(value, dict) else value


def tokenizer_from_folder(folder: Path, spec: ModelSpec):
    """(tokenizer, chat template source or None)."""
    cfg_file = folder / "tokenizer_config.json"
    tcfg = json.loads(cfg_file.read_text()) if cfg_file.is_file() else {}
    template = tcfg.get("chat_template")
    jinja = folder / "chat_template.jinja"
    if jinja.is_file():
        template = jinja.read_text()
    tok_file = folder / "tokenizer.json"
    if tok_file.is_file():
        backend = _HFTokenizer.from_file(str(tok_file))
        special = {t.content: i for i, t in backend.get_added_tokens_decoder().items() if t.special}
        bos_text, eos_text = _token_text(tcfg.get("bos_token")), _token_text(tcfg.get("eos_token"))
        eos = set(spec.eos_token_ids)
        if eos_text and backend.token_to_id(eos_text) is not None:
            eos.add(backend.token_to_id(eos_text))
        bos = backend.token_to_id(bos_text) if bos_text else spec.bos_token_id
        tok = Tokenizer(backend, bos_id=bos, eos_ids=tuple(sorted(eos)), add_bos=bool(tcfg.get("add_bos_token")),
                        special=special)
    elif spec.arch == "qwen3_5":
        from .qwen_tiktoken import QwenTiktokenTokenizer

        tok = QwenTiktokenTokenizer(spec.eos_token_ids)
        if template is None:
            template = (BUILTIN_TEMPLATES / "qwen3_5.jinja").read_text()
    else:
        raise ModelFormatError(f"{folder} has no tokenizer.json", hint="copy the model's tokenizer files into it")
    if tok.vocab_size > spec.vocab_size:
        raise ModelFormatError(f"tokenizer has {tok.vocab_size} tokens but the model's vocab_size is "
                               f"{spec.vocab_size}")
    return tok, template
