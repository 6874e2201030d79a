"""Tokenizers behind one interface, plus chat templates."""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from functools import cache

from tokenizers import Tokenizer as _HFTokenizer
from tokenizers.decoders import DecodeStream

_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")  # SentencePiece's byte-fallback tokens


@cache
def _byte_values() -> dict[str, int]:
    """GPT-2's byte alphabet read backwards: the byte each letter of a byte-level BPE vocabulary spells."""
    from .byte_level import byte_alphabet  # it builds Tokenizers: imported on first use

    return {letter: byte for byte, letter in byte_alphabet().items()}


@dataclass
class Tokenizer:
    """A `tokenizers` tokenizer plus the ids generation needs.

    `special` maps every added special token's text to its id; `eos_ids` end a generation.
    """

    backend: _HFTokenizer
    bos_id: int | None = None
    eos_ids: tuple[int, ...] = ()
    add_bos: bool = False
    special: dict[str, int] = field(default_factory=dict)

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special: bool = False) -> list[int]:
        ids = self.backend.encode(text, add_special_tokens=False).ids
        if add_special and self.add_bos and self.bos_id is not None:
            ids = [self.bos_id, *ids]
        return ids

    def decode(self, ids: list[int], skip_special: bool = False) -> str:
        return self.backend.decode(ids, skip_special_tokens=skip_special)

    def token_text(self, token_id: int) -> str:
        return self.backend.decode([token_id], skip_special_tokens=False)

    def token_bytes(self, token_id: int) -> bytes:
        """The token's own bytes: a token that holds part of a character decodes alone to U+FFFD, so its bytes
        come from its vocabulary entry (a byte-level BPE spelling, or a <0xNN> byte-fallback token)."""
        text = self.token_text(token_id)
        piece = self.backend.id_to_token(token_id)
        if "\ufffd" not in text or piece is None:
            return text.encode("utf-8")
        if (byte := _FALLBACK.fullmatch(piece)) is not None:
            return bytes([int(byte[1], 16)])
        values = _byte_values()
        if all(c in values for c in piece):
            return bytes(values[c] for c in piece)
        return text.encode("utf-8")

    def stream(self) -> StreamDecoder:
        return StreamDecoder(self)


class StreamDecoder:
    """Turns generated ids into text pieces, holding back incomplete UTF-8 sequences."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tok = tokenizer
        self._stream = DecodeStream(skip_special_tokens=False)

    def push(self, token_id: int) -> str:
        return self._stream.step(self._tok.backend, token_id) or ""
