"""Tokenizers behind one interface, plus chat templates."""
from __future__ import annotations

from dataclasses import dataclass, field

from tokenizers import Tokenizer as _HFTokenizer
from tokenizers.decoders import DecodeStream


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

    def stream(self) -> StreamDecoder:
        return StreamDecoder(self)


class StreamDecoder:
    """Turns generated ids into text pieces, holding back incomplete UTF-8 sequences."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tok = tokenizer
        self._stream = DecodeStream(skip_special_tokens=False)

    def push(self, token_id: int) -> str:
        return self._stream.step(self._tok.backend, token_id) or ""
