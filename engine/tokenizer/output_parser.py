"""Splits generated text into reasoning, visible text and tool calls, token by token.

Formats: `<think>...</think>` reasoning; tool calls in Qwen3.5's XML form
`<tool_call><function=NAME><parameter=K>V</parameter></function></tool_call>` or the hermes JSON form
`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`. A call that cannot be parsed is returned as text,
never as a call with broken arguments. Shared by the API server and the chat front ends.
"""
from __future__ import annotations

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


def _param_value(raw: str):
    value = raw.strip("\n")
    try:
        return json.loads(value)
    except ValueError:
        return value


def parse_tool_calls(body: str) -> list[ToolCall] | None:
    """The calls in one `<tool_call>` body, or None when it is not a well-formed call."""
    functions = _FUNCTION_RE.findall(body)
    if functions:
        if _FUNCTION_RE.sub("", body).strip():
            return None  # something besides whole functions: truncated or garbled
        calls = []
        for name, inner in functions:
            params = _PARAM_RE.findall(inner)
            if _PARAM_RE.sub("", inner).strip():
                return None
            calls.append(ToolCall(name.strip(), {k.strip(): _param_value(v) for k, v in params}))
        return calls
    try:
        obj = json.loads(body)
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return [ToolCall(obj["name"], args)]


def _held_suffix(text: str, tags: tuple[str, ...]) -> int:
    """Length of the longest end of `text` that could still grow into one of `tags`."""
    best = 0
    for tag in tags:
        for n in range(min(len(tag) - 1, len(text)), best, -1):
            if text.endswith(tag[:n]):
                best = n
                break
    return best


class OutputParser:
    def __init__(self, in_reasoning: bool = False, tools: bool = True) -> None:
        self.mode = "reasoning" if in_reasoning else "text"
        self.tools = tools
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
        return (CALL_CLOSE,)

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
            self._text(out, before)
            self._ws = ""
            self.mode = {THINK_OPEN: "reasoning", THINK_CLOSE: "text", CALL_OPEN: "tool"}[tag]
            self._lead = tag == THINK_CLOSE

    def _call(self, out: list[Piece], body: str, closed: bool) -> None:
        calls = parse_tool_calls(body.strip()) if closed else None
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


def parse_all(text: str, in_reasoning: bool = False, tools: bool = True) -> tuple[str, str, list[ToolCall]]:
    """(reasoning, text, calls) of a whole completion."""
    p = OutputParser(in_reasoning, tools)
    pieces = p.feed(text) + p.finish()
    return ("".join(x.text for x in pieces if x.kind == "reasoning"),
            "".join(x.text for x in pieces if x.kind == "text"),
            [x.call for x in pieces if x.kind == "tool_call"])
