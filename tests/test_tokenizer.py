"""The GGUF-embedded tokenizer: round trips, agreement with transformers, llama.cpp's digit rule."""
import pytest

MIXED = [
    "Hello, world! How are you today?",
    "日本語のテキストと中文混合 — 한국어도",
    "emoji 🚀🔥👩‍💻 and symbols ∑∫√",
    "def f(x):\n    return x ** two  # comment\n\n\tindented\ttabs",
    "   leading spaces, trailing spaces   ",
    "<|im_start|>user\nhi there<|im_end|>\n",
    "multiple\n\n\nnewlines   and    runs",
]


@pytest.fixture(scope="module")
def hf_tokenizer(default_model_path):
    transformers = pytest.importorskip("transformers")
    from pathlib import Path

    p = Path(default_model_path)
    return transformers.AutoTokenizer.from_pretrained(str(p.parent), gguf_file=p.name)


@pytest.mark.parametrize("text", MIXED + ["numbers 12345 and 3.14159", "x  *  2"])
def test_round_trip(default_engine, text):
    tok = default_engine.tokenizer
    assert tok.decode(tok.encode(text)) == text


@pytest.mark.parametrize("text", MIXED)
def test_agrees_with_transformers(default_engine, hf_tokenizer, text):
    assert default_engine.tokenizer.encode(text) == hf_tokenizer.encode(text, add_special_tokens=False)


def test_digits_split_before_words(default_engine):
    # llama.cpp's "smollm" pre-tokenizer (and SmolLM2's own tokenizer.json: Digits(individual) first) isolates
    # each digit before the GPT-2 rule, so the spaces before a number stay one piece; transformers' GGUF path
    # applies the GPT-2 rule alone and would give "  2" -> " ", " 2".
    tok = default_engine.tokenizer
    pieces = [tok.decode([i]) for i in tok.encode("a  2024")]
    assert pieces == ["a", "  ", "2", "0", "2", "4"]


def test_special_tokens_are_single_ids(default_engine):
    tok = default_engine.tokenizer
    assert tok.encode("<|im_start|>") == [tok.special["<|im_start|>"]]
    assert tok.eos_ids == (2,)


def test_stream_decoder_holds_partial_utf8(default_engine):
    tok = default_engine.tokenizer
    text = "naïve 🚀 日本"
    ids = tok.encode(text)
    stream = tok.stream()
    pieces = [stream.push(i) for i in ids]
    assert "".join(pieces) == text
    assert all("\ufffd" not in p for p in pieces)
