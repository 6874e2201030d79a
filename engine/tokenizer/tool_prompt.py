"""Tools for chat templates that know nothing of them: the tool list goes into the system message and calls /
results become hermes-style `<tool_call>` / `<tool_response>` text, which the output parser reads back."""
from __future__ import annotations

import json

_INSTRUCTIONS = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n{tools}\n</tools>\n\n"
    "For each function call, return a json object with function name and arguments within <tool_call></tool_call> "
    'XML tags:\n<tool_call>\n{{"name": <function-name>, "arguments": <args-json-object>}}\n</tool_call>'
)


def _call_text(call: dict) -> str:
    fn = call.get("function", call)
    return "<tool_call>\n" + json.dumps({"name": fn.get("name"), "arguments": fn.get("arguments", {})},
                                        ensure_ascii=False) + "\n</tool_call>"


def inline_tools(messages: list[dict], tools: list[dict] | None) -> list[dict]:
    out: list[dict] = []
    if tools:
        listing = _INSTRUCTIONS.format(tools="\n".join(json.dumps(t, ensure_ascii=False) for t in tools))
        if messages and messages[0].get("role") == "system":
            out.append({"role": "system", "content": f"{messages[0].get('content') or ''}\n\n{listing}"})
            messages = messages[1:]
        else:
            out.append({"role": "system", "content": listing})
    for m in messages:
        role, content = m.get("role"), m.get("content") or ""
        if role == "assistant" and m.get("tool_calls"):
            calls = "\n".join(_call_text(c) for c in m["tool_calls"])
            out.append({"role": "assistant", "content": f"{content}\n{calls}" if content else calls})
        elif role == "tool":
            text = f"<tool_response>\n{content}\n</tool_response>"
            if out and out[-1]["role"] == "user" and out[-1].get("_tool"):
                out[-1] = {**out[-1], "content": out[-1]["content"] + "\n" + text}
            else:
                out.append({"role": "user", "content": text, "_tool": True})
        else:
            out.append({**m, "content": content})
    return [{k: v for k, v in m.items() if k != "_tool"} for m in out]
