"""Reading an architecture's keys from GGUF metadata (`<arch>.<key>`), with the missing ones named."""
from __future__ import annotations

from ..errors import ModelFormatError

_REQUIRED = object()


class MetaReader:
    def __init__(self, meta: dict, arch: str) -> None:
        self.meta, self.arch = meta, arch

    def __call__(self, key: str, default=_REQUIRED):
        """`<arch>.<key>`, or `default`; a key without a default must be there."""
        full = f"{self.arch}.{key}"
        if full in self.meta:
            return self.meta[full]
        if default is _REQUIRED:
            raise ModelFormatError(f"GGUF metadata lacks {full!r}", hint="the file is incomplete or was written "
                                   "by a converter ninfer does not know; convert the model again")
        return default

    def special_tokens(self) -> dict:
        """ModelSpec's bos_token_id and eos_token_ids from the tokenizer keys."""
        bos = self.meta.get("tokenizer.ggml.bos_token_id")
        eos = self.meta.get("tokenizer.ggml.eos_token_id")
        return {"bos_token_id": None if bos is None else int(bos), "eos_token_ids": () if eos is None else (int(eos),)}
