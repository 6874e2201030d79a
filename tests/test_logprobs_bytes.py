"""Logprob entries of tokens that hold part of a character (engine/server/logprobs.py), on the Qwen vocabulary,
which splits emoji and rare CJK characters across tokens: each token's `bytes` are its own, its text is written
as OpenAI writes such bytes, and completions' `text_offset` counts characters of the text, streamed or not."""
import pytest

from engine.runtime.request import TokenLogprob
from engine.server.logprobs import TextOffsets, chat_entries, completion_logprobs
from engine.tokenizer.byte_level import byte_level_tokenizer

TEXT = "I love 😊 and 𝔘 and 龘 ok"


@pytest.fixture(scope="module")
def qwen():
    from engine.tokenizer.qwen_tiktoken import QwenTiktokenTokenizer

    return QwenTiktokenTokenizer()


def _logprobs(ids: list[int]) -> list[TokenLogprob]:
    return [TokenLogprob(-1.0, ((i, -1.0),)) for i in ids]


def _offsets(tokenizer, ids: list[int]) -> list[int]:
    """The characters of TEXT that end before each token's first byte, counted on the text itself."""
    ends, at = [], 0
    for ch in TEXT:
        at += len(ch.encode())
        ends.append(at)
    starts, at = [], 0
    for i in ids:
        starts.append(sum(end <= at for end in ends))
        at += len(tokenizer.token_bytes(i))
    return starts


def test_a_split_character_keeps_its_bytes_in_chat_entries(qwen):
    ids = qwen.encode(TEXT)
    entries = chat_entries(qwen, ids, _logprobs(ids))
    assert b"".join(bytes(e["bytes"]) for e in entries).decode() == TEXT
    smile = next(e for e in entries if e["bytes"][:2] == [32, 0xF0])  # " " and the first three bytes of 😊
    assert smile["bytes"] == list(" 😊".encode()[:4]) and smile["token"] == " \\xf0\\x9f\\x98"
    assert {e["token"] for e in entries} >= {"\\x8a", " and", " ok"}  # 😊's last byte; whole tokens as text
    assert all(e["top_logprobs"][0]["bytes"] == e["bytes"] for e in entries)


def test_completions_name_partial_tokens_by_bytes_and_count_offsets_in_characters(qwen):
    ids = qwen.encode(TEXT)
    lp = completion_logprobs(qwen, ids, _logprobs(ids))
    assert "bytes: \\xf0\\x9f\\x98" in lp["tokens"] and "bytes:\\x8a" in lp["tokens"]
    assert lp["tokens"][0] == "I" and lp["tokens"][-1] == " ok"
    assert lp["text_offset"] == _offsets(qwen, ids)
    assert lp["text_offset"][-1] == len(TEXT) - len(" ok")
    assert list(lp["top_logprobs"][1]) == [lp["tokens"][1]]


def test_streamed_chunks_split_mid_character_give_the_same_offsets(qwen):
    ids = qwen.encode(TEXT)
    cut = next(i for i, t in enumerate(ids) if qwen.token_bytes(t).startswith(b" \xf0")) + 1  # inside 😊
    offsets = TextOffsets()
    parts = [completion_logprobs(qwen, chunk, _logprobs(chunk), offsets) for chunk in (ids[:cut], ids[cut:])]
    assert [o for p in parts for o in p["text_offset"]] == _offsets(qwen, ids)


def test_a_byte_tokenizer_gives_each_byte_token_its_byte():
    tok = byte_level_tokenizer()
    assert [tok.token_bytes(b) for b in "é".encode()] == [b"\xc3", b"\xa9"]
    assert tok.token_bytes(ord("a")) == b"a" and tok.token_bytes(tok.special["<|im_end|>"]) == b"<|im_end|>"
    (entry,) = chat_entries(tok, [0xC3], _logprobs([0xC3]))
    assert (entry["token"], entry["bytes"]) == ("\\xc3", [0xC3])


def test_bytes_that_make_no_character_count_as_one_where_the_text_replaces_them():
    tok = byte_level_tokenizer()
    ids = [ord("a"), 0xEF, ord("1"), 0xE4, 0xB8, 0xAD, 0xFF, ord("b")]  # "a", a lone lead byte, "1", 中, 0xff, "b"
    raw = b"".join(tok.token_bytes(i) for i in ids)
    assert raw.decode("utf-8", "replace") == "a\ufffd1中\ufffdb"
    lp = completion_logprobs(tok, ids, _logprobs(ids))
    assert lp["text_offset"] == [0, 1, 2, 3, 3, 3, 4, 5]  # 中 ends in its third byte's token
    assert lp["tokens"][1] == "bytes:\\xef" and lp["tokens"][3:6] == ["bytes:\\xe4", "bytes:\\xb8", "bytes:\\xad"]
