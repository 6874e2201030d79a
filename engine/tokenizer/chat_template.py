"""Chat templates: the checkpoint's jinja2 template rendered the way transformers renders it."""
from __future__ import annotations

import json
from datetime import datetime

from jinja2 import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment

from ..errors import ModelFormatError, UserError
from .tool_prompt import inline_tools


def _raise(message: str) -> None:
    raise TemplateError(message)


def _tojson(value, indent=None, ensure_ascii=False, sort_keys=False, separators=None) -> str:
    return json.dumps(value, indent=indent, ensure_ascii=ensure_ascii, sort_keys=sort_keys, separators=separators)


class ChatTemplate:
    def __init__(self, source: str, bos_token: str = "", eos_token: str = "") -> None:
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=["jinja2.ext.loopcontrols"])
        env.filters["tojson"] = _tojson
        env.filters["fromjson"] = json.loads
        env.globals["raise_exception"] = _raise
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        try:
            self._template = env.from_string(source)
        except TemplateError as exc:
            raise ModelFormatError(f"the model's chat template does not parse: {exc}") from None
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.supports_tools = "tools" in source and "tool_call" in source
        # Qwen3.5/3.6 templates teach <function=NAME><parameter=K>; others (and `inline_tools`) JSON calls
        self.calls_in_xml = self.supports_tools and "<function=" in source

    def render(self, messages: list[dict], add_generation_prompt: bool = True, tools: list | None = None,
               **kwargs) -> str:
        if not self.supports_tools and (tools or any(m.get("role") == "tool" or m.get("tool_calls")
                                                     for m in messages)):
            messages, tools = inline_tools(messages, tools), None
        try:
            return self._template.render(
                messages=messages, tools=tools, add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token, eos_token=self.eos_token, **kwargs,
            )
        except TemplateError as exc:
            raise UserError(f"the chat template rejected the conversation: {exc}") from None
