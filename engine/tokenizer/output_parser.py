"""Splits generated text into reasoning, visible text and tool calls, token by token.

Formats: `<think>...</think>` reasoning; tool calls in Qwen3.5's XML form
`<tool_call><function=NAME><parameter=K>V</parameter></function></tool_call>` or the hermes JSON form
`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`. A call that cannot be parsed is returned as text,
never as a call with broken arguments. Shared by the API server and the chat front ends.

Models slip in known ways, and a slip read as text ends an agent's turn: Python literals (True, None, single
quotes), the arguments as one JSON object inside <function=...>, the closing tags missing at the end of the output
(or a next <tool_call> before the last one closed), a number or an array written as a string. Those are read as
the call meant, with the tool's schema deciding each parameter's type (`coerce`). A call cut off inside a
parameter's value is still text: its arguments are not known.
"""
from __future__ import annotations

import ast
import json
import logging
import re
import uuid
from dataclasses import dataclass, field

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
_FUNCTION_RE = re.compile(r"<function=([^>\n]+)>(.*?)</function>", re.S)
log = logging.getLogger("ninfer.parser")
_PARAM_RE = re.compile(r"<parameter=([^>\n]+)>(.*?)</parameter>", re.S)


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict
    id: str = field(default_factory=lambda: uuid.uuid4().hex[:24])

    @property
    def arguments_json(self) -> str:
        return json.dumps(self.arguments, ensure_ascii=False)


@dataclass(frozen=True)
class Piece:
    kind: str  # "text" | "reasoning" | "tool_call"
    text: str = ""
    call: ToolCall | None = None


_NOT_A_VALUE = object()


def _literal(text: str):
    """`text` as JSON, else as a Python literal (True/False/None, single quotes, tuples) made JSON's; or
    _NOT_A_VALUE."""
    try:
        return json.loads(text)
    except ValueError:
        pass
    try:
        value = ast.literal_eval(text.strip())
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        return _NOT_A_VALUE
    try:  # only what JSON can hold (no bytes, sets, complex numbers)
        return json.loads(json.dumps(value, allow_nan=False))
    except (TypeError, ValueError):
        return _NOT_A_VALUE


def _types(schema) -> set[str]:
    kind = schema.get("type") if isinstance(schema, dict) else None
    return {kind} if isinstance(kind, str) else set(kind) if isinstance(kind, list) else set()


def coerce(value, schema):
    """A parameter's value read as its schema's type where the model wrote it as another: a number, boolean,
    array or object written as a string (or as a Python literal), an integral float for an integer. Anything
    else is left as it is (the schema is the client's to check)."""
    types = _types(schema)
    if not types or isinstance(value, bool) and "boolean" in types:
        return value
    if isinstance(value, str) and "string" not in types:
        parsed = _literal(value)
        if parsed is not _NOT_A_VALUE and not isinstance(parsed, str):
            value = parsed
    if "integer" in types and isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, list) and "array" in types:
        items = schema.get("items")
        return [coerce(v, items) for v in value] if isinstance(items, dict) else value
    if isinstance(value, dict) and "object" in types:
        return coerce_arguments(value, schema)
    return value


def coerce_arguments(args: dict, schema) -> dict:
    props = schema.get("properties") if isinstance(schema, dict) else None
    if not isinstance(props, dict):
        return args
    return {k: coerce(v, props.get(k)) for k, v in args.items()}


def _param_value(raw: str, schema):
    """An XML parameter's text: a string parameter's raw text (a JSON string literal decoded), any other JSON or a
    Python literal, coerced to the schema's type; raw text when it is no value at all."""
    text = raw.strip("\n")
    if _types(schema) == {"string"}:
        if text.strip().startswith('"'):
            decoded = _literal(text)
            if isinstance(decoded, str):
                return decoded
        return text
    value = _literal(text)
    return text if value is _NOT_A_VALUE else coerce(value, schema)


def _function(name: str, inner: str, schemas: dict[str, dict]) -> ToolCall | None:
    schema = schemas.get(name, {})
    params = _PARAM_RE.findall(inner)
    rest = _PARAM_RE.sub("", inner).strip()
    if rest:
        args = _literal(rest) if not params else _NOT_A_VALUE  # the arguments as one JSON object
        if not isinstance(args, dict):
            return None
        return ToolCall(name, coerce_arguments(args, schema))
    props = schema.get("properties") if isinstance(schema.get("properties"), dict) else {}
    return ToolCall(name, {k.strip(): _param_value(v, props.get(k.strip())) for k, v in params})


def _closed(body: str) -> str:
    """A call body that ended (the output's end, or a next <tool_call>) without its closing tags, closed: only
    after a whole parameter (every one opened was closed), never inside a value."""
    body = body.rstrip()
    if body.endswith("</function>") or "<function=" not in body:
        return body
    if body.count("<parameter=") != body.count("</parameter>"):
        return body  # cut off inside a value
    return body + "\n</function>"


def parse_tool_calls(body: str, schemas: dict[str, dict] | None = None, closed: bool = True) -> list[ToolCall] | None:
    """The calls in one `<tool_call>` body, or None when it is not a well-formed call. `schemas`: each tool's
    parameters schema by name, which types its arguments; `closed` False: the body ended without its closing
    tags (see `_closed`)."""
    schemas = schemas or {}
    if not closed:
        body = _closed(body)
    functions = _FUNCTION_RE.findall(body)
    if functions:
        if _FUNCTION_RE.sub("", body).strip():
            return None  # something besides whole functions: truncated or garbled
        calls = [_function(name.strip(), inner, schemas) for name, inner in functions]
        return None if None in calls else calls
    obj = _literal(body)
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        args = _literal(args)
    if not isinstance(args, dict):
        return None
    return [ToolCall(obj["name"], coerce_arguments(args, schemas.get(obj["name"], {})))]


def _held_suffix(text: str, tags: tuple[str, ...]) -> int:
    """Length of the longest end of `text` that could still grow into one of `tags`."""
    best = 0
    for tag in tags:
        for n in range(min(len(tag) - 1, len(text)), best, -1):
            if text.endswith(tag[:n]):
                best = n
                break
    return best


def tool_schemas(tools) -> dict[str, dict]:
    """Each tool's parameters schema by name, from tools in OpenAI chat's shape."""
    out = {}
    for t in tools if isinstance(tools, list) else ():
        fn = t.get("function", t) if isinstance(t, dict) else None
        if isinstance(fn, dict) and isinstance(fn.get("name"), str) and isinstance(fn.get("parameters"), dict):
            out[fn["name"]] = fn["parameters"]
    return out


class OutputParser:
    def __init__(self, in_reasoning: bool = False, tools: bool | list[dict] = True) -> None:
        """`tools`: whether calls are read, or the request's tools (OpenAI chat's shape), whose schemas type
        the calls' arguments."""
        self.mode = "reasoning" if in_reasoning else "text"
        self.tools = bool(tools)
        self.schemas = tool_schemas(tools)
        self._buf = ""
        self._ws = ""  # whitespace-only text held until it is known to lead somewhere
        self.saw_call = False
        self._lead = True
        self.warnings: list[str] = []

    def _tags(self) -> tuple[str, ...]:
        if self.mode == "text":
            return (THINK_OPEN, CALL_OPEN) if self.tools else (THINK_OPEN,)
        if self.mode == "reasoning":
            return (THINK_CLOSE, CALL_OPEN) if self.tools else (THINK_CLOSE,)
        return (CALL_CLOSE, CALL_OPEN)  # a next call opening ends this one (its closing tags missing)

    def _text(self, out: list[Piece], text: str) -> None:
        if not text:
            return
        if self.mode == "reasoning":
            out.append(Piece("reasoning", text))
            return
        # Trailing whitespace waits until it is known to lead to more text (not to a tag or the end of a call).
        text = self._ws + text
        core = text.rstrip()
        self._ws = text[len(core):]
        if not core:
            return
        if self._lead:  # text right after reasoning, a call, or at the start: no leading blank lines
            core, self._lead = core.lstrip(), False
        out.append(Piece("text", core))

    def feed(self, piece: str) -> list[Piece]:
        out: list[Piece] = []
        self._buf += piece
        while True:
            tags = self._tags()
            hits = [(i, t) for t in tags if (i := self._buf.find(t)) >= 0]
            if not hits:
                if self.mode != "tool":
                    keep = _held_suffix(self._buf, tags)
                    self._text(out, self._buf[: len(self._buf) - keep])
                    self._buf = self._buf[len(self._buf) - keep:]
                return out
            i, tag = min(hits)
            before, self._buf = self._buf[:i], self._buf[i + len(tag):]
            if tag == CALL_CLOSE:
                self._call(out, before, closed=True)
                self.mode = "text"
                continue
            if self.mode == "tool":  # <tool_call> again: the open call ended without its closing tags
                self._call(out, before, closed=False)
                self.mode = "tool"
                continue
            self._text(out, before)
            self._ws = ""
            self.mode = {THINK_OPEN: "reasoning", THINK_CLOSE: "text", CALL_OPEN: "tool"}[tag]
            self._lead = tag == THINK_CLOSE

    def _call(self, out: list[Piece], body: str, closed: bool) -> None:
        calls = parse_tool_calls(body.strip(), self.schemas, closed)
        if calls is None:
            what = "an unparseable" if closed else "a truncated"
            log.warning("%s tool call was returned as text: %.80r", what, body)
            self.mode = "text"
            self._text(out, CALL_OPEN + body + (CALL_CLOSE if closed else ""))
            return
        self.saw_call = True
        self._lead = True
        out.extend(Piece("tool_call", call=c) for c in calls)

    def finish(self) -> list[Piece]:
        out: list[Piece] = []
        rest, self._buf = self._buf, ""
        if self.mode == "tool":
            self._call(out, rest, closed=False)
        else:
            self._text(out, rest)
        if self._ws and not self._lead and self.mode == "text":
            out.append(Piece("text", self._ws))
        self._ws = ""
        return out


def parse_all(text: str, in_reasoning: bool = False,
              tools: bool | list[dict] = True) -> tuple[str, str, list[ToolCall]]:
    """(reasoning, text, calls) of a whole completion."""
    p = OutputParser(in_reasoning, tools)
    pieces = p.feed(text) + p.finish()
    return ("".join(x.text for x in pieces if x.kind == "reasoning"),
            "".join(x.text for x in pieces if x.kind == "text"),
            [x.call for x in pieces if x.kind == "tool_call"])
