"""OpenAI-compatible routes: /v1/chat/completions, /v1/completions, /v1/models."""
from __future__ import annotations

import json
import time
import uuid

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse

from ..runtime.request import FinishEvent, TokenEvent
from ..tokenizer.output_parser import OutputParser, ToolCall
from .bridge import (
    Run,
    collect,
    completion_budget,
    field_of,
    prepare_chat,
    request_errors,
    sampling,
    sse,
    stop_list,
)
from .errors import bad_request

router = APIRouter()


TEXT_PARTS = ("text", "input_text", "output_text", "reasoning_text", "summary_text")


def text_of(content, where: str, param: str = "messages") -> str:
    """The text of an OpenAI content field: a string, or text parts (chat and Responses part types)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            kind = part.get("type") if isinstance(part, dict) else None
            if kind in TEXT_PARTS:
                parts.append(str(part.get("text", "")))
            elif kind == "refusal":
                parts.append(str(part.get("refusal", "")))
            else:
                raise bad_request(f"{where}: content part type {kind!r} is not supported (text only)", param=param)
        return "".join(parts)
    raise bad_request(f"{where}: 'content' must be a string or a list of parts", param=param)


def tool_arguments(raw, where: str) -> dict:
    if isinstance(raw, dict):
        return raw
    if isinstance(raw, str):
        try:
            value = json.loads(raw) if raw.strip() else {}
        except ValueError:
            raise bad_request(f"{where}: function.arguments is not valid JSON", param="messages") from None
        if isinstance(value, dict):
            return value
    raise bad_request(f"{where}: function.arguments must be a JSON object", param="messages")


def template_messages(messages) -> list[dict]:
    """OpenAI messages -> the chat template's message dicts (tool-call arguments as objects)."""
    if not isinstance(messages, list) or not messages:
        raise bad_request("'messages' must be a non-empty array", param="messages")
    out = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise bad_request(f"{where} must be an object", param="messages")
        role = m.get("role")
        if role == "developer":
            role = "system"
        if role not in ("system", "user", "assistant", "tool"):
            raise bad_request(f"{where}: unknown role {role!r}", param="messages")
        msg: dict = {"role": role, "content": text_of(m.get("content"), where)}
        if role == "assistant":
            reasoning = m.get("reasoning_content") or m.get("reasoning")
            if isinstance(reasoning, str) and reasoning:
                msg["reasoning_content"] = reasoning
            calls = m.get("tool_calls") or []
            if not isinstance(calls, list):
                raise bad_request(f"{where}: tool_calls must be an array", param="messages")
            converted = []
            for c in calls:
                fn = c.get("function") if isinstance(c, dict) else None
                if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
                    raise bad_request(f"{where}: each tool call needs function.name", param="messages")
                converted.append({"id": c.get("id"), "type": "function",
                                  "function": {"name": fn["name"], "arguments": tool_arguments(fn.get("arguments"),
                                                                                           where)}})
            if converted:
                msg["tool_calls"] = converted
        if role == "tool":
            msg["tool_call_id"] = m.get("tool_call_id")
        out.append(msg)
    return out


def check_tools(tools) -> list[dict] | None:
    if tools is None:
        return None
    if not isinstance(tools, list) or not all(isinstance(t, dict) and isinstance(t.get("function"), dict)
                                              and isinstance(t["function"].get("name"), str) for t in tools):
        raise bad_request("'tools' must be an array of {type: 'function', function: {name, ...}}", param="tools")
    return tools or None


def stream_error(exc: Exception) -> str:
    """A failure after the stream began, as a final chunk in OpenAI's error shape."""
    return sse({"error": {"message": f"generation failed: {exc}", "type": "server_error", "param": None,
                          "code": None}})


def usage(final: FinishEvent) -> dict:
    return {"prompt_tokens": final.prompt_tokens, "completion_tokens": final.completion_tokens,
            "total_tokens": final.prompt_tokens + final.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": final.cached_tokens}}


def _tool_call_json(call: ToolCall, index: int | None = None) -> dict:
    out = {"id": f"call_{call.id}", "type": "function",
           "function": {"name": call.name, "arguments": call.arguments_json}}
    return out if index is None else {"index": index, **out}


def _finish_reason(final: FinishEvent, saw_call: bool) -> str:
    if saw_call:
        return "tool_calls"
    return "length" if final.finish_reason == "length" else "stop"


@router.post("/v1/chat/completions")
async def chat_completions(request: Request):
    app = request.app.state.server
    engine, body = await app.begin(request)
    settings = app.settings
    messages = template_messages(body.get("messages"))
    if field_of(body, "n", int, 1) != 1:
        raise bad_request("only n = 1 is supported", param="n")
    tools = check_tools(body.get("tools"))
    if body.get("tool_choice") == "none":
        tools = None
    kwargs = field_of(body, "chat_template_kwargs", dict, {})
    stream = field_of(body, "stream", bool, False)
    include_usage = bool((field_of(body, "stream_options", dict, {}) or {}).get("include_usage"))
    with request_errors():
        prep = prepare_chat(engine, messages, tools, kwargs)
        asked = field_of(body, "max_completion_tokens", int) or field_of(body, "max_tokens", int)
        budget = completion_budget(engine, len(prep.prompt_ids), asked, settings.sampling_defaults.get(
            "max_tokens", 512))
        params = sampling(body, settings.sampling_defaults, budget, stop_list(body.get("stop"), "stop"))
        run = Run(engine, prep.prompt_ids, params, app.metrics, "chat.completions")
    rid, created = f"chatcmpl-{uuid.uuid4().hex[:24]}", int(time.time())
    parser = OutputParser(prep.in_reasoning, tools=bool(tools))

    def chunk(delta: dict, finish: str | None = None) -> dict:
        return {"id": rid, "object": "chat.completion.chunk", "created": created, "model": body["model"],
                "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}]}

    if stream:
        async def events():
            yield sse(chunk({"role": "assistant", "content": ""}))
            calls = 0
            try:
                async for event in run.events():
                    if isinstance(event, TokenEvent):
                        pieces = parser.feed(event.text)
                    else:
                        pieces = parser.finish()
                    for p in pieces:
                        if p.kind == "text":
                            yield sse(chunk({"content": p.text}))
                        elif p.kind == "reasoning":
                            yield sse(chunk({"reasoning_content": p.text, "reasoning": p.text}))
                        else:
                            yield sse(chunk({"tool_calls": [_tool_call_json(p.call, calls)]}))
                            calls += 1
                    if isinstance(event, FinishEvent):
                        yield sse(chunk({}, _finish_reason(event, parser.saw_call)))
                        if include_usage:
                            yield sse({"id": rid, "object": "chat.completion.chunk", "created": created,
                                       "model": body["model"], "choices": [], "usage": usage(event)})
            except Exception as exc:  # never a broken stream without a word: report in the API's error shape
                yield stream_error(exc)
            yield sse("[DONE]")

        return StreamingResponse(events(), media_type="text/event-stream", headers={"cache-control": "no-cache"})

    final = await collect(request, run)
    reasoning, text, calls = [], [], []
    for p in parser.feed(final.text) + parser.finish():
        {"text": text, "reasoning": reasoning, "tool_call": calls}[p.kind].append(p)
    message: dict = {"role": "assistant", "content": "".join(p.text for p in text) or (None if calls else "")}
    if reasoning:
        message["reasoning_content"] = message["reasoning"] = "".join(p.text for p in reasoning)
    if calls:
        message["tool_calls"] = [_tool_call_json(p.call) for p in calls]
    return JSONResponse({
        "id": rid, "object": "chat.completion", "created": created, "model": body["model"],
        "choices": [{"index": 0, "message": message, "logprobs": None,
                     "finish_reason": _finish_reason(final, bool(calls))}],
        "usage": usage(final),
    })


@router.post("/v1/completions")
async def completions(request: Request):
    app = request.app.state.server
    engine, body = await app.begin(request)
    settings = app.settings
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    with request_errors():
        if isinstance(prompt, str) and prompt:
            ids = engine.tokenizer.encode(prompt, add_special=True)
        elif isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
            ids = prompt
        else:
            raise bad_request("'prompt' must be a non-empty string or an array of token ids", param="prompt")
        budget = completion_budget(engine, len(ids), field_of(body, "max_tokens", int, 16), 16)
        params = sampling(body, settings.sampling_defaults, budget, stop_list(body.get("stop"), "stop"))
        run = Run(engine, ids, params, app.metrics, "completions")
    rid, created = f"cmpl-{uuid.uuid4().hex[:24]}", int(time.time())

    def body_of(text: str, finish: str | None, final: FinishEvent | None = None) -> dict:
        out = {"id": rid, "object": "text_completion", "created": created, "model": body["model"],
               "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish}]}
        if final is not None:
            out["usage"] = usage(final)
        return out

    if field_of(body, "stream", bool, False):
        include_usage = bool((field_of(body, "stream_options", dict, {}) or {}).get("include_usage"))

        async def events():
            try:
                async for event in run.events():
                    if isinstance(event, TokenEvent):
                        if event.text:
                            yield sse(body_of(event.text, None))
                    else:
                        reason = "length" if event.finish_reason == "length" else "stop"
                        yield sse(body_of("", reason, event if include_usage else None))
            except Exception as exc:
                yield stream_error(exc)
            yield sse("[DONE]")

        return StreamingResponse(events(), media_type="text/event-stream", headers={"cache-control": "no-cache"})
    final = await collect(request, run)
    return JSONResponse(body_of(final.text, "length" if final.finish_reason == "length" else "stop", final))


@router.get("/v1/models")
async def models(request: Request):
    settings = request.app.state.server.settings
    created = int(request.app.state.server.started)
    return {"object": "list", "data": [{"id": name, "object": "model", "created": created, "owned_by": "ninfer"}
                                       for name in (settings.model_id, *settings.aliases)]}
