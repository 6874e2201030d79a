"""Grammars for constrained decoding, through llguidance: a request's `Grammar` compiled against the model's
vocabulary (`GrammarCompiler`), and the `Matcher` that follows its output token by token.

llguidance rather than xgrammar: a JSON schema compiles in about a millisecond (every new schema is compiled on
its request's path), the matcher rolls back and checks draft tokens itself, a Lark grammar embeds JSON schemas
(the tool-call grammar), and the wheel depends on nothing (xgrammar pulls in transformers and a runtime of its
own). Compile and mask times of both: scripts/bench_grammar.py, scripts/results/bench_grammar_cpu.json."""
from __future__ import annotations

import json
import threading
from collections import OrderedDict

import llguidance
import numpy as np

from ..errors import UserError
from ..runtime.request import Grammar

# JSON is written as json.dumps writes it (Qwen's templates render JSON so): no free whitespace, which a model
# could otherwise emit forever inside a valid prefix, and which only pretty-printing wants.
JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
COMPILED_KEPT = 64  # compiled grammars kept per engine: agent clients resend the same schemas every turn
THINK_CLOSE = "</think>"


def mask_words(vocab_size: int) -> int:
    """32-bit words of one row's token bitmask."""
    return (vocab_size + 31) // 32


def _lark_string(text: str) -> str:
    return json.dumps(text, ensure_ascii=False)


class GrammarCompiler:
    """Compiles requests' grammars against one tokenizer. Thread-safe: requests are compiled on the server's
    worker threads while the engine core makes matchers on its own."""

    def __init__(self, tokenizer, vocab_size: int) -> None:
        self.tokenizer, self.vocab_size = tokenizer, vocab_size
        self._lock = threading.Lock()
        self._ll: llguidance.LLTokenizer | None = None
        self._compiled: OrderedDict[Grammar, str] = OrderedDict()

    @property
    def ll_tokenizer(self) -> llguidance.LLTokenizer:
        """The vocabulary as llguidance sees it, built on first use (about a second for a 248K vocabulary: an
        engine that never constrains never pays it). Ids past the tokenizer's (padded embedding rows) have no
        bytes, so no grammar allows them."""
        with self._lock:
            if self._ll is None:
                self._ll = _ll_tokenizer(self.tokenizer, self.vocab_size)
            return self._ll

    def special(self, text: str) -> str:
        """A special token as a Lark grammar writes it (its id), or the text itself where the vocabulary has no
        such special token."""
        token = self.tokenizer.special.get(text)
        return f"<[{token}]>" if token is not None else _lark_string(text)

    def reasoning_prefix(self) -> str:
        """The Lark rule `reasoning` of free text closed by </think> and the whitespace after it: what a model whose
        prompt opened a <think> block writes before the constrained part."""
        close = self.tokenizer.special.get(THINK_CLOSE)
        if close is None:
            return f"reasoning[suffix={_lark_string(THINK_CLOSE)}]: /(?s:.*)/ /[ \\t\\r\\n]*/\n"
        return f"reasoning: /(?s:.*)/ <[{close}]> /[ \\t\\r\\n]*/\n"

    def compile(self, grammar: Grammar) -> str:
        """The grammar in llguidance's form, checked against the vocabulary; UserError saying why when it cannot
        be compiled (an unknown schema keyword in a strict schema, a bad regex, a $ref to nowhere)."""
        with self._lock:
            if grammar in self._compiled:
                self._compiled.move_to_end(grammar)
                return self._compiled[grammar]
        text = self._source(grammar)
        failed, messages = llguidance.LLMatcher.validate_grammar_with_warnings(text, self.ll_tokenizer)
        if failed:
            raise UserError(f"the {grammar.kind.replace('_', ' ')} cannot be used to constrain the output: "
                            f"{_first_line(messages[0])}", hint=_HINTS[grammar.kind])
        with self._lock:
            self._compiled[grammar] = text
            while len(self._compiled) > COMPILED_KEPT:
                self._compiled.popitem(last=False)
        return text

    def matcher(self, grammar: Grammar) -> Matcher:
        return Matcher(llguidance.LLMatcher(self.ll_tokenizer, self.compile(grammar), log_level=0),
                       self.vocab_size)

    def _source(self, grammar: Grammar) -> str:
        kind, source = grammar.kind, grammar.source
        if kind in ("json_schema", "json_object"):
            schema = {"type": "object"} if kind == "json_object" else _schema(source)
            if not grammar.reasoning:
                return llguidance.LLMatcher.grammar_from_json_schema(schema, overrides=json_options(grammar.strict))
            body = json_rule(schema, grammar.strict)
        elif kind == "regex":
            if not grammar.reasoning:
                return llguidance.LLMatcher.grammar_from_regex(source)
            body = "/" + source.replace("/", "\\/") + "/"
        elif kind == "lark":
            return llguidance.LLMatcher.grammar_from_lark(source)
        else:
            try:
                return llguidance.grammar_from("gbnf", source)
            except ValueError as exc:
                raise UserError(f"the GBNF grammar does not parse: {_first_line(str(exc))}",
                                hint=_HINTS["gbnf"]) from None
        return llguidance.LLMatcher.grammar_from_lark(f"start: reasoning value\nvalue: {body}\n"
                                                      + self.reasoning_prefix())


_HINTS = {
    "json_schema": "use the JSON Schema keywords of OpenAI's structured outputs, or send strict: false to ignore "
                   "the ones that are not supported",
    "json_object": "",
    "regex": "use Rust regex syntax (no lookaround or backreferences)",
    "lark": "see llguidance's Lark syntax",
    "gbnf": "see llama.cpp's GBNF syntax",
}


def json_options(strict: bool) -> dict:
    """llguidance's JSON compile options: the layout, and with `strict` False unknown keywords ignored."""
    return JSON_LAYOUT if strict else {**JSON_LAYOUT, "lenient": True}


def json_rule(schema: dict | bool, strict: bool) -> str:
    """A JSON schema as the body of a Lark rule (%json); its "x-guidance" key carries the compile options."""
    if isinstance(schema, dict):
        schema = {**schema, "x-guidance": json_options(strict)}
    return "%json " + json.dumps(schema, ensure_ascii=False)


def _first_line(message: str) -> str:
    return message.strip().splitlines()[0] if message.strip() else "unknown error"


def _schema(source: str) -> dict | bool:
    try:
        schema = json.loads(source)
    except ValueError as exc:
        raise UserError(f"the JSON schema is not valid JSON: {exc}") from None
    if not isinstance(schema, (dict, bool)):
        raise UserError("the JSON schema must be a JSON object")
    return schema


def _ll_tokenizer(tokenizer, vocab_size: int) -> llguidance.LLTokenizer:
    """llguidance's view of one of our tokenizers: tiktoken ranks (the Qwen vocabulary without a tokenizer.json)
    or a `tokenizers` tokenizer, serialised."""
    eos = list(tokenizer.eos_ids)
    enc = getattr(tokenizer, "_enc", None)
    if enc is not None:
        return llguidance.LLTokenizer.from_tiktoken(encoder=enc._mergeable_ranks, special_tokens=enc._special_tokens,
                                                    pattern=enc._pat_str, eos_token=eos, n_vocab=vocab_size)
    return llguidance.LLTokenizer(tokenizer.backend.to_str(), n_vocab=vocab_size, eos_token=eos)


class Matcher:
    """A request's place in its grammar. `masks` gives the allowed tokens of a step's rows (after each of the
    step's drafts), `advance` moves on by an output token; a grammar that allows nothing more is `done`."""

    def __init__(self, matcher: llguidance.LLMatcher, vocab_size: int) -> None:
        self._m, self.vocab_size, self.words = matcher, vocab_size, mask_words(vocab_size)

    def copy(self) -> Matcher:
        """An independent matcher at the same place (the further choices of a request for several): a copy of
        the parser's state, where a new matcher would build the grammar's parser again."""
        return Matcher(self._m.deep_copy(), self.vocab_size)

    def valid_drafts(self, drafts: list[int]) -> int:
        """How many of the drafts, in order, the grammar allows from here: a refused draft ends the run (the
        target could never output it, so neither it nor any draft after it can be accepted)."""
        return self._m.validate_tokens(drafts) if drafts else 0

    def masks(self, drafts: list[int], out: np.ndarray) -> None:
        """Row i of `out` [len(drafts) + 1, words] (int32): the tokens allowed after the drafts before i. The
        drafts must be allowed (`valid_drafts`); the matcher ends where it began."""
        for i, token in enumerate(drafts):
            self._fill(out[i])
            if not self._m.consume_token(token):
                raise RuntimeError(f"draft token {token} is not allowed here: {self._m.get_error()}")
        self._fill(out[len(drafts)])
        if drafts:
            self._m.rollback(len(drafts))

    def _fill(self, row: np.ndarray) -> None:
        self._m.unsafe_compute_mask_ptr(row.ctypes.data, row.nbytes)

    def advance(self, token: int) -> bool:
        """Output `token` (one the mask allowed); True when the grammar allows nothing after it (the output is
        complete)."""
        if not self._m.consume_token(token):
            raise RuntimeError(f"token {token} is not allowed by the grammar: {self._m.get_error()}")
        return self._m.is_stopped()
