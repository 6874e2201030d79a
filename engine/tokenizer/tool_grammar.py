"""Lark grammars of tool calls, so a forced or strict call is one the output parser reads and its arguments follow
the tool's schema.

Two forms, as the chat template teaches them: Qwen3.5/3.6's XML
`<tool_call>\\n<function=NAME>\\n<parameter=K>\\nVALUE\\n</parameter>\\n</function>\\n</tool_call>` (a string
parameter's value raw, any other JSON, as the template writes history), or the JSON form
`<tool_call>\\n{"name": NAME, "arguments": {...}}\\n</tool_call>` of templates without tools (`tool_prompt.py`)."""
from __future__ import annotations

import json

from ..errors import UserError
from ..runtime.request import Grammar
from .grammar import GrammarCompiler, json_rule

CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
PARAM_END = json.dumps("\n</parameter>\n")  # as Lark literals
FUNCTION_END = json.dumps("</function>\n")
ARGUMENTS_END = json.dumps("}\n")
_STRING_KEYS = frozenset({"type", "description", "title", "examples", "default"})  # a string with nothing else


def _lit(text: str) -> str:
    return json.dumps(text, ensure_ascii=False)


def _raw_string(schema) -> bool:
    """A parameter written as raw text: a plain string (a constrained one, enum or pattern or format, is written
    as JSON, which the parser decodes, so its grammar is the schema's)."""
    return isinstance(schema, dict) and schema.get("type") == "string" and set(schema) <= _STRING_KEYS


def _json_rule(schema, defs: dict, strict: bool) -> str:
    return json_rule({**schema, **defs} if isinstance(schema, dict) else schema, strict)


def _parameters(tool: dict) -> tuple[dict, bool]:
    fn = tool.get("function", tool)
    schema = fn.get("parameters") or {"type": "object"}
    if not isinstance(schema, dict):
        raise UserError(f"the parameters of tool {fn.get('name')!r} must be a JSON schema object")
    return schema, bool(fn.get("strict"))


def _xml_call(i: int, name: str, schema: dict, strict: bool, open_: str, close: str) -> list[str]:
    defs = {k: schema[k] for k in ("$defs", "definitions") if k in schema}
    props = schema.get("properties")
    rules = []
    if isinstance(props, dict) and props:
        required = set(schema.get("required") or ())
        parts = []
        for j, (key, sub) in enumerate(props.items()):
            head = _lit(f"<parameter={key}>\n")
            if _raw_string(sub):
                rules.append(f"c{i}_{j}: {head} c{i}_{j}_v\n")
                rules.append(f"c{i}_{j}_v[suffix={PARAM_END}]: /(?s:.*)/\n")
            else:
                rules.append(f"c{i}_{j}: {head} c{i}_{j}_v {PARAM_END}\n")
                rules.append(f"c{i}_{j}_v: {_json_rule(sub, defs, strict)}\n")
            parts.append(f"c{i}_{j}" if key in required else f"c{i}_{j}?")
        body = " ".join(parts)
    else:  # no declared properties: any parameters, raw text
        rules.append(f"c{i}_any: \"<parameter=\" /[^>\\n]+/ \">\\n\" c{i}_any_v\n")
        rules.append(f"c{i}_any_v[suffix={PARAM_END}]: /(?s:.*)/\n")
        body = f"c{i}_any*"
    head = _lit(f"\n<function={name}>\n")
    rules.insert(0, f"c{i}: {open_} {head} {body} {FUNCTION_END} {close}\n")
    return rules


def _json_call(i: int, name: str, schema: dict, strict: bool, open_: str, close: str) -> list[str]:
    head = _lit("\n" + json.dumps({"name": name}, ensure_ascii=False)[:-1] + ', "arguments": ')
    return [f"c{i}: {open_} {head} c{i}_args {ARGUMENTS_END} {close}\n",
            f"c{i}_args: {_json_rule(schema, {}, strict)}\n"]


def tool_call_grammar(compiler: GrammarCompiler, tools: list[dict], name: str | None, xml: bool,
                      reasoning: bool, required: bool = True) -> Grammar:
    """Calls of `tools` (the OpenAI chat shape, {type, function: {name, parameters, strict}}): one call of the
    tool `name`, or with name None one or more calls of any of them; `required` False lets the output be plain
    text instead (strict tools under tool_choice auto). A tool marked strict gets its schema exactly, others
    leniently (keywords the library lacks are ignored). `reasoning`: free reasoning and </think> come first."""
    open_, close = compiler.special(CALL_OPEN), compiler.special(CALL_CLOSE)
    rules, alternatives = [], []
    for t in tools:
        fn = t.get("function", t)
        if name is not None and fn.get("name") != name:
            continue
        schema, strict = _parameters(t)
        i = len(alternatives)
        rules += (_xml_call if xml else _json_call)(i, fn["name"], schema, strict, open_, close)
        alternatives.append(f"c{i}")
    if not alternatives:
        raise UserError(f"no tool named {name!r} to call")
    calls = alternatives[0] if name is not None else f"call (\"\\n\" call)*\ncall: {' | '.join(alternatives)}"
    if not required:
        # text that never opens a call (where <tool_call> is plain text, the words themselves are excluded)
        text = "/(?s:.*)/" if CALL_OPEN in compiler.tokenizer.special else "/(?s:.*)/ & ~/(?s:.*<tool_call>.*)/"
        rules.append(f"text: TEXT\nTEXT: {text}\n")
        calls = f"text | text? calls_\ncalls_: {calls}"
    lark = ("start: reasoning calls\n" if reasoning else "start: calls\n") + f"calls: {calls}\n" + "".join(rules)
    if reasoning:
        lark += compiler.reasoning_prefix()
    return Grammar("lark", lark)
