"""Anthropic-compatible routes: /v1/messages (with the full streaming event sequence) and count_tokens."""
from __future__ import annotations

import uuid

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse

from ..runtime.request import FinishEvent, TokenEvent
from ..tokenizer.output_parser import OutputParser
from .bridge import (
    Job,
    Run,
    chat_job,
    check_choice,
    field_of,
    prepare,
    prepare_chat,
    sampling,
    sse,
    stop_list,
    template_kwargs,
)
from .constraints import Constraint, tool_calls
from .errors import bad_request
from .images import IMAGE_SLOT, ImagePart, decoded, ready_images

router = APIRouter()


def _blocks(content, where: str) -> list[dict]:
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    if isinstance(content, list) and all(isinstance(b, dict) and isinstance(b.get("type"), str) for b in content):
        return content
    raise bad_request(f"{where}: 'content' must be a string or an array of content blocks")


def _result_text(content, where: str, images: list[ImagePart] | None) -> str:
    """A tool_result's text; with `images`, its image blocks too (Claude Code's Read tool returns a picture so),
    each an IMAGE_SLOT in the text."""
    if content is None:
        return ""
    parts = []
    for k, b in enumerate(_blocks(content, where)):
        if b["type"] == "image" and images is not None:
            images.append((f"{where}.content.{k}", _image_block(b.get("source"), f"{where}.content.{k}")))
            parts.append(IMAGE_SLOT)
        elif b["type"] == "text":
            parts.append(str(b.get("text", "")))
        else:
            raise bad_request(f"{where}: tool_result content of type {b['type']!r} is not supported (text and "
                              "images only)")
    return "".join(parts)


ATTRIBUTION_PREFIX = "x-anthropic-billing-header"


def system_text(system) -> str:
    """The system prompt, without Claude Code's per-request attribution block (it changes every request and
    would end prefix reuse right at the start of the prompt)."""
    if system is None:
        return ""
    blocks = [{"type": "text", "text": system}] if isinstance(system, str) else _blocks(system, "system")
    texts = []
    for i, b in enumerate(blocks):
        if b["type"] != "text" or not isinstance(b.get("text", ""), str):
            raise bad_request(f"system.{i}: only text blocks are supported in the system prompt, got "
                              f"{b['type']!r}" + (" with a non-string text" if b["type"] == "text" else ""))
        texts.append(b.get("text", ""))
    kept = []
    for text in texts:
        lines = [ln for ln in text.split("\n") if not ln.startswith(ATTRIBUTION_PREFIX)]
        if any(ln.strip() for ln in lines):
            kept.append("\n".join(lines))
    return "\n\n".join(kept)


def template_messages(body: dict, images: list[ImagePart] | None = None) -> list[dict]:
    """Anthropic system + messages -> the chat template's message dicts (tool_use -> tool_calls,
    tool_result -> tool messages, thinking -> reasoning_content); the user turns' image blocks, and those of their
    tool results, go to `images` (an IMAGE_SLOT in the text where each was), in the prompt's order."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad_request("'messages' must be a non-empty array")
    out: list[dict] = []
    system = system_text(body.get("system"))
    if system:
        out.append({"role": "system", "content": system})
    for i, m in enumerate(messages):
        where = f"messages.{i}"
        if isinstance(m, dict) and m.get("role") == "system":
            # Mid-conversation system notes (Claude Code sends them): kept in place as a user turn, since chat
            # templates accept a system message only first and moving it would break prefix reuse.
            text = system_text(m.get("content"))
            if text:
                out.append({"role": "user", "content": f"[system]\n{text}"})
            continue
        if not isinstance(m, dict) or m.get("role") not in ("user", "assistant"):
            raise bad_request(f"{where}: role must be 'user', 'assistant' or 'system'")
        text, reasoning, calls = [], [], []
        typed: list[ImagePart] = []  # the turn's own images: after its tool results' in the prompt
        for j, b in enumerate(_blocks(m.get("content"), where)):
            kind = b["type"]
            if kind == "text":
                text.append(str(b.get("text", "")))
            elif kind == "thinking":
                reasoning.append(str(b.get("thinking", "")))  # the signature is accepted, not checked
            elif kind == "redacted_thinking":
                continue
            elif kind == "image" and m["role"] == "user" and images is not None:
                typed.append((f"{where}.content.{j}", _image_block(b.get("source"), f"{where}.content.{j}")))
                text.append(IMAGE_SLOT)
            elif kind == "tool_use" and m["role"] == "assistant":
                if not isinstance(b.get("name"), str) or not isinstance(b.get("input", {}), dict):
                    raise bad_request(f"{where}.content.{j}: tool_use needs a name and an input object")
                calls.append({"id": b.get("id"), "type": "function",
                              "function": {"name": b["name"], "arguments": b.get("input", {})}})
            elif kind == "tool_result" and m["role"] == "user":
                result = _result_text(b.get("content"), f"{where}.content.{j}", images)
                if b.get("is_error"):
                    result = f"Error: {result}"
                out.append({"role": "tool", "content": result, "tool_call_id": b.get("tool_use_id")})
            else:
                raise bad_request(f"{where}.content.{j}: block type {kind!r} is not supported in a "
                                  f"{m['role']} message")
        if images is not None:
            images.extend(typed)
        if m["role"] == "user" and not text and any(o["role"] == "tool" for o in out[-1:]):
            continue  # a turn of tool results only
        msg: dict = {"role": m["role"], "content": "".join(text)}
        if reasoning:
            msg["reasoning_content"] = "".join(reasoning)
        if calls:
            msg["tool_calls"] = calls
        out.append(msg)
    return out


def _image_block(source, where: str) -> bytes | str:
    """An image block's bytes (a base64 source), or its http(s) URL (a url source: `ready_images` fetches it)."""
    kind = source.get("type") if isinstance(source, dict) else None
    if kind == "base64":
        return decoded(source.get("data"), source.get("media_type"), where)
    url = source.get("url") if kind == "url" else None
    if isinstance(url, str) and url.startswith(("http://", "https://")):
        return url
    raise bad_request(f"{where}: an image block needs a base64 source or a url source with an http(s) URL")


def openai_tools(tools) -> list[dict] | None:
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise bad_request("'tools' must be an array")
    out = []
    for i, t in enumerate(tools):
        if not isinstance(t, dict) or not isinstance(t.get("name"), str):
            raise bad_request(f"tools.{i}: a tool needs a name")
        if "input_schema" not in t:
            continue  # server tools (web search, ...) are not ours to run
        fn = {"name": t["name"], "description": t.get("description", ""), "parameters": t["input_schema"]}
        if t.get("strict") is True:  # its calls' input follows the schema exactly (a grammar)
            fn["strict"] = True
        out.append({"type": "function", "function": fn})
    return out or None


def _usage(final: FinishEvent, output_tokens: int | None = None) -> dict:
    return {"input_tokens": final.prompt_tokens - final.cached_tokens, "output_tokens":
            final.completion_tokens if output_tokens is None else output_tokens,
            "cache_read_input_tokens": final.cached_tokens, "cache_creation_input_tokens": 0}


def _stop_reason(final: FinishEvent, saw_call: bool) -> tuple[str, str | None]:
    if saw_call:
        return "tool_use", None
    if final.finish_reason == "length":
        return "max_tokens", None
    if final.stop_string is not None:
        return "stop_sequence", final.stop_string
    return "end_turn", None


def tool_choice(choice, tools: list[dict] | None) -> tuple[list[dict] | None, Constraint | None]:
    """The tools a request's tool_choice leaves the model ({type: none}: none; a named tool must be one of them)
    and the calls it forces (any, tool) or makes exact (tools with strict: true under auto)."""
    if choice is None:
        return tools, tool_calls(tools, "auto")
    kind = choice.get("type") if isinstance(choice, dict) else None
    if kind not in ("auto", "any", "tool", "none"):
        raise bad_request("tool_choice must be {type: 'auto' | 'any' | 'tool' | 'none'}")
    if kind == "none":
        return None, None
    if kind == "tool":
        check_choice(choice.get("name"), tools, "tool_choice.name")
        return tools, tool_calls(tools, "named", choice["name"])
    return tools, tool_calls(tools, "required" if kind == "any" else "auto")


def _template_input(body: dict, images: list[ImagePart]) -> tuple[list[dict], list[dict] | None, dict,
                                                                        Constraint | None]:
    messages = template_messages(body, images)
    tools, calls = tool_choice(body.get("tool_choice"), openai_tools(body.get("tools")))
    kwargs = template_kwargs(body)
    thinking = field_of(body, "thinking", dict)
    if thinking is not None:
        kwargs.setdefault("enable_thinking", thinking.get("type") in ("enabled", "adaptive"))
    return messages, tools, kwargs, calls


def _count_job(engine, body: dict, settings) -> int:
    images: list[ImagePart] = []
    ids = prepare_chat(engine, *_template_input(body, images)[:3]).prompt_ids
    return engine.prompt_tokens(ids, ready_images(engine, images, settings))


@router.post("/v1/messages/count_tokens")
async def count_tokens(request: Request):
    _, count = await prepare(request, _count_job)
    return {"input_tokens": count}


def _messages_job(engine, body: dict, settings) -> Job:
    max_tokens = field_of(body, "max_tokens", int, required=True, lo=1)
    stream = field_of(body, "stream", bool, False)
    params = sampling(body, settings.sampling_defaults, stop_list(body.get("stop_sequences"), "stop_sequences"),
                      temp_max=1.0)
    images: list[ImagePart] = []
    messages, tools, kwargs, calls = _template_input(body, images)
    return chat_job(engine, params, messages, tools, kwargs, max_tokens, max_tokens, calls, stream=stream,
                    images=ready_images(engine, images, settings))


@router.post("/v1/messages")
async def messages(request: Request):
    body, job = await prepare(request, _messages_job)
    run = Run(request, job, "messages")
    mid = f"msg_{uuid.uuid4().hex[:24]}"
    parser = OutputParser(job.in_reasoning, tools=job.tools or False)
    head = {"id": mid, "type": "message", "role": "assistant", "model": body["model"]}

    if job.stream:
        async def events():
            start_usage = {"input_tokens": len(job.prompt_ids), "output_tokens": 0,
                           "cache_read_input_tokens": 0, "cache_creation_input_tokens": 0}
            yield sse({"type": "message_start", "message": {**head, "content": [], "stop_reason": None,
                                                            "stop_sequence": None, "usage": start_usage}},
                      "message_start")
            yield sse({"type": "ping"}, "ping")
            index, open_kind = -1, None
            try:
                async for event in run.events():
                    pieces = parser.feed(event.text) if isinstance(event, TokenEvent) else parser.finish()
                    for p in pieces:
                        if open_kind is not None and (p.kind != open_kind or p.kind == "tool_call"):
                            yield sse({"type": "content_block_stop", "index": index}, "content_block_stop")
                            open_kind = None
                        if open_kind is None:
                            index += 1
                            open_kind = p.kind
                            block = {"text": {"type": "text", "text": ""},
                                     "reasoning": {"type": "thinking", "thinking": "", "signature": ""}}.get(
                                p.kind) or {"type": "tool_use", "id": f"toolu_{p.call.id}", "name": p.call.name,
                                            "input": {}}
                            yield sse({"type": "content_block_start", "index": index, "content_block": block},
                                      "content_block_start")
                        if p.kind == "text":
                            delta = {"type": "text_delta", "text": p.text}
                        elif p.kind == "reasoning":
                            delta = {"type": "thinking_delta", "thinking": p.text}
                        else:
                            delta = {"type": "input_json_delta", "partial_json": p.call.arguments_json}
                        yield sse({"type": "content_block_delta", "index": index, "delta": delta},
                                  "content_block_delta")
                    if isinstance(event, FinishEvent):
                        if open_kind is not None:
                            yield sse({"type": "content_block_stop", "index": index}, "content_block_stop")
                        reason, seq = _stop_reason(event, parser.saw_call)
                        yield sse({"type": "message_delta", "delta": {"stop_reason": reason, "stop_sequence": seq},
                                   "usage": _usage(event)}, "message_delta")
                        yield sse({"type": "message_stop"}, "message_stop")
            except Exception as exc:
                yield sse({"type": "error", "error": {"type": "api_error", "message": f"generation failed: {exc}"}},
                          "error")

        return StreamingResponse(events(), media_type="text/event-stream", headers={"cache-control": "no-cache"})

    final = (await run.collect())[0]
    content = []
    for p in parser.feed(final.text) + parser.finish():
        if p.kind == "tool_call":
            content.append({"type": "tool_use", "id": f"toolu_{p.call.id}", "name": p.call.name,
                            "input": p.call.arguments})
        elif content and content[-1]["type"] == ("text" if p.kind == "text" else "thinking"):
            content[-1]["text" if p.kind == "text" else "thinking"] += p.text
        elif p.kind == "text":
            content.append({"type": "text", "text": p.text})
        else:
            content.append({"type": "thinking", "thinking": p.text, "signature": ""})
    if not content:
        content.append({"type": "text", "text": ""})
    reason, seq = _stop_reason(final, parser.saw_call)
    return JSONResponse({**head, "content": content, "stop_reason": reason, "stop_sequence": seq,
                         "usage": _usage(final)})
