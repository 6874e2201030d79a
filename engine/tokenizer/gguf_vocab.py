"""Build a `tokenizers` byte-level BPE tokenizer from GGUF tokenizer metadata (llama.cpp's key names)."""
from __future__ import annotations

from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as _HFTokenizer

from ..errors import ModelFormatError
from . import Tokenizer
from .byte_level import byte_alphabet

_GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN35_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+"
    r"|\s+(?!\S)|\s+"
)
# llama.cpp's pre-tokenizer per `tokenizer.ggml.pre`: a list of split regexes applied in order.
# The "digits first" family splits every digit on its own before the GPT-2 rule (llama-vocab.cpp).
_PRE_SPLITS: dict[str, tuple[str, ...]] = {
    **{name: (_GPT2_SPLIT,) for name in ("default", "gpt2", "gpt-2", "mpt", "olmo", "jais")},
    **{name: (r"\p{N}", _GPT2_SPLIT) for name in ("smollm", "starcoder", "refact", "command-r", "codeshell")},
    **{name: (_LLAMA3_SPLIT,) for name in ("llama3", "llama-v3", "llama-bpe", "smaug-bpe", "dbrx")},
    **{name: (_QWEN2_SPLIT,) for name in ("qwen2", "deepseek-r1-qwen")},
    "qwen35": (_QWEN35_SPLIT,),
}
_CONTROL, _USER_DEFINED = 3, 4


def tokenizer_from_gguf(meta: dict) -> Tokenizer:
    model = meta.get("tokenizer.ggml.model")
    if model != "gpt2":
        raise ModelFormatError(
            f"GGUF tokenizer model {model!r} is not supported", hint="supported: gpt2 (byte-level BPE)"
        )
    pre = meta.get("tokenizer.ggml.pre", "default")
    if pre not in _PRE_SPLITS:
        raise ModelFormatError(
            f"GGUF pre-tokenizer {pre!r} is not supported", hint="supported: " + ", ".join(sorted(_PRE_SPLITS))
        )
    tokens: list[str] = list(meta["tokenizer.ggml.tokens"])
    types: list[int] = list(meta.get("tokenizer.ggml.token_type", [1] * len(tokens)))
    merges = [tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges", [])]
    alphabet = byte_alphabet()
    letters = set(alphabet.values())
    vocab = {}
    for i, tok in enumerate(tokens):
        spelled = tok if set(tok) <= letters else "".join(alphabet[b] for b in tok.encode("utf-8"))
        vocab.setdefault(spelled, i)
    # tokenizers panics (an exception no handler should catch) on a merge of tokens the vocabulary lacks
    bad = next((m for m in merges if len(m) != 2 or m[0] not in vocab or m[1] not in vocab
                or m[0] + m[1] not in vocab), None)
    if bad is not None:
        raise ModelFormatError(f"the GGUF tokenizer's merge {' '.join(bad)!r} joins tokens its vocabulary lacks",
                               hint="the file's tokenizer.ggml.tokens and merges disagree; convert the model again")
    backend = _HFTokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    splits = [pre_tokenizers.Split(Regex(rx), behavior="isolated") for rx in _PRE_SPLITS[pre]]
    backend.pre_tokenizer = pre_tokenizers.Sequence([*splits, pre_tokenizers.ByteLevel(add_prefix_space=False,
                                                                                      use_regex=False)])
    backend.decoder = decoders.ByteLevel()
    special = {}
    control = [AddedToken(t, special=True, normalized=False) for t, ty in zip(tokens, types, strict=True)
               if ty == _CONTROL and set(t) <= letters]
    user = [AddedToken(t, special=False, normalized=False) for t, ty in zip(tokens, types, strict=True)
            if ty == _USER_DEFINED]
    backend.add_special_tokens(control)
    backend.add_tokens(user)
    for tok in control:
        special[tok.content] = backend.token_to_id(tok.content)
    bos = meta.get("tokenizer.ggml.bos_token_id")
    eos = meta.get("tokenizer.ggml.eos_token_id")
    eos_ids = {int(eos)} if eos is not None else set()
    eot = meta.get("tokenizer.ggml.eot_token_id")
    if eot is not None:
        eos_ids.add(int(eot))
    return Tokenizer(
        backend=backend,
        bos_id=None if bos is None else int(bos),
        eos_ids=tuple(sorted(eos_ids)),
        add_bos=bool(meta.get("tokenizer.ggml.add_bos_token", False)),
        special=special,
    )
