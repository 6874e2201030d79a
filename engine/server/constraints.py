"""What a request asks its output to be, in each API's words, as the engine's grammar: OpenAI's `response_format`
and the Responses API's `text.format` (JSON mode, JSON schema), tool calls forced by a tool choice (required,
any, a named tool) and tools marked `strict`. A schema the grammar library cannot use is a 400 that says why.

One constraint a request: a forced tool call wins over a response format, which wins over strict tools under
tool_choice auto (whose grammar lets the model answer in plain text or call a tool with exact arguments)."""
from __future__ import annotations

import json
from dataclasses import dataclass, replace

from ..errors import UserError
from ..runtime.request import Grammar, SamplingParams
from .errors import bad_request


@dataclass(frozen=True)
class Constraint:
    """A response format (`schema` a JSON schema, or None for any JSON object) or tool calls (`tools`, forced
    when `required`, of the tool `name` when one is named)."""

    param: str  # the request field it came from, for errors
    schema: dict | bool | None = None
    strict: bool = True
    tools: list[dict] | None = None
    name: str | None = None
    required: bool = True

    def apply(self, engine, params: SamplingParams, reasoning: bool) -> SamplingParams:
        """`params` with the grammar (compiled now, off the event loop); 400 when it cannot be compiled."""
        try:
            if self.tools is not None:
                grammar = engine.tool_call_grammar(self.tools, self.name, reasoning, self.required)
            else:
                kind = "json_object" if self.schema is None else "json_schema"
                grammar = Grammar(kind, "" if self.schema is None else json.dumps(self.schema), self.strict,
                                  reasoning)
                engine.check_grammar(grammar)
        except UserError as exc:
            hint = f"; {exc.hint}" if exc.hint else ""
            raise bad_request(f"'{self.param}': {exc}{hint}", param=self.param, code="invalid_schema") from None
        return replace(params, grammar=grammar)


def response_format(value, param: str = "response_format") -> Constraint | None:
    """OpenAI chat's response_format: {type: text | json_object | json_schema, json_schema: {name, schema,
    strict}}."""
    return _format(value, param, "json_schema")


def text_format(text, param: str = "text") -> Constraint | None:
    """The Responses API's text.format: {type: text | json_object | json_schema, name, schema, strict}."""
    if text is not None and not isinstance(text, dict):
        raise bad_request(f"'{param}' must be an object", param=param)
    return _format((text or {}).get("format"), f"{param}.format", None)


def _format(value, param: str, nested: str | None) -> Constraint | None:
    """A response format; the schema's fields under the key `nested` (chat) or beside the type (Responses)."""
    if value is None:
        return None
    kind = value.get("type") if isinstance(value, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return Constraint(param)
    if kind != "json_schema":
        raise bad_request(f"'{param}.type' must be 'text', 'json_object' or 'json_schema'", param=param.split(".")[0])
    spec = value.get(nested) if nested else value
    if not isinstance(spec, dict):
        raise bad_request(f"'{param}.{nested}' must be an object with 'name' and 'schema'", param=param)
    return _schema(spec, param)


def _schema(spec: dict, param: str) -> Constraint:
    schema = spec.get("schema", {})
    if not isinstance(schema, (dict, bool)):
        raise bad_request(f"'{param}': the schema must be a JSON object", param=param)
    strict = spec.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise bad_request(f"'{param}': strict must be a boolean", param=param)
    return Constraint(param, schema=schema, strict=bool(strict))


def tool_calls(tools: list[dict] | None, mode: str, name: str | None = None,
               param: str = "tool_choice") -> Constraint | None:
    """Tool calls a tool choice asks for (`tools` in OpenAI chat's shape): `mode` 'required' (one or more
    calls), 'named' (one call of `name`), 'auto' (strict tools only: text, or calls with exact arguments) or
    'none'."""
    if not tools or mode == "none":
        return None
    if mode == "auto":
        if not any(t["function"].get("strict") is True for t in tools):
            return None
        return Constraint(param, tools=tools, required=False)
    return Constraint(param, tools=tools, name=name if mode == "named" else None)


def ordered(calls: Constraint | None, output: Constraint | None) -> Constraint | None:
    """The one constraint that applies (the module's order): forced calls, else the response format, else
    strict tools' calls."""
    if calls is not None and calls.required:
        return calls
    return output if output is not None else calls
