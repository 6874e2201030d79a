"""Byte-level BPE helpers: GPT-2's byte alphabet, and a merge-free byte tokenizer for tiny synthetic models."""
from __future__ import annotations

from tokenizers import AddedToken, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as _HFTokenizer

from . import Tokenizer

SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>", "<tool_call>", "</tool_call>",
            "<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")


def byte_alphabet() -> dict[int, str]:
    """GPT-2's reversible byte -> printable-unicode map (the alphabet byte-level BPE vocabularies are spelt in)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs), strict=True))


def byte_level_backend() -> _HFTokenizer:
    """Ids 0..255 are the bytes, 256.. the specials (ChatML, thinking, tool calls); no merges."""
    alphabet = byte_alphabet()
    backend = _HFTokenizer(models.BPE(vocab={alphabet[b]: b for b in range(256)}, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in SPECIALS])
    return backend


def byte_level_tokenizer() -> Tokenizer:
    backend = byte_level_backend()
    special = {s: backend.token_to_id(s) for s in SPECIALS}
    return Tokenizer(backend, bos_id=None, eos_ids=(special["<|im_end|>"], special["<|endoftext|>"]),
                     special=special)
