"""OpenAI-compatible routes: /v1/chat/completions, /v1/completions, /v1/models."""
from __future__ import annotations

import json
import time
import uuid
from dataclasses import replace

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse

from ..runtime.request import MAX_CHOICES, MAX_TOP_LOGPROBS, FinishEvent, TokenEvent
from ..tokenizer.output_parser import OutputParser, ToolCall
from .bridge import (
    Job,
    Run,
    chat_job,
    check_choice,
    encode_prompt,
    field_of,
    make_job,
    prepare,
    sampling,
    sse,
    stop_list,
    template_kwargs,
    unsupported,
)
from .constraints import Constraint, ordered, response_format, tool_calls
from .errors import bad_request
from .images import IMAGE_SLOT, VIDEO_SLOT, ImagePart, image_source, ready_images, video_source
from .logprobs import TextOffsets, chat_entries, completion_logprobs

router = APIRouter()


TEXT_PARTS = ("text", "input_text", "output_text", "reasoning_text", "summary_text")
IMAGE_PARTS = ("image_url", "input_image")


def text_of(content, where: str, param: str = "messages", images: list[ImagePart] | None = None) -> str:
    """The text of an OpenAI content field: a string, or text parts (chat and Responses part types); with
    `images`, image parts too (`image_url`, `input_image`) and video parts (`video_url`): their data goes there, an
    IMAGE_SLOT (a VIDEO_SLOT) into the text."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for j, part in enumerate(content):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind in IMAGE_PARTS and images is not None:
                url = part.get("image_url")
                url = url.get("url") if isinstance(url, dict) else url  # chat nests it; Responses does not
                images.append((f"{where}.content[{j}]", image_source(url, f"{where}.content[{j}]", param)))
                parts.append(IMAGE_SLOT)
            elif kind == "video_url" and images is not None:
                url = part.get("video_url")
                url = url.get("url") if isinstance(url, dict) else url
                images.append((f"{where}.content[{j}]", video_source(url, f"{where}.content[{j}]", param)))
                parts.append(VIDEO_SLOT)
            elif kind in TEXT_PARTS or kind == "refusal":
                text = part.get("refusal" if kind == "refusal" else "text", "")
                if not isinstance(text, str):
                    raise bad_request(f"{where}: a {kind} part's text must be a string", param=param)
                parts.append(text)
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


def template_messages(messages, images: list[ImagePart] | None = None) -> list[dict]:
    """OpenAI messages -> the chat template's message dicts (tool-call arguments as objects); the user turns'
    image parts go to `images`."""
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
        msg: dict = {"role": role, "content": text_of(m.get("content"), where,
                                                      images=images if role == "user" else None)}
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


def usage(finals: list[FinishEvent]) -> dict:
    """A request's usage: its prompt once (its choices share it), every choice's completion."""
    first, made = finals[0], sum(f.completion_tokens for f in finals)
    return {"prompt_tokens": first.prompt_tokens, "completion_tokens": made, "total_tokens": first.prompt_tokens + made,
            "prompt_tokens_details": {"cached_tokens": first.cached_tokens}}


def choices_field(body: dict) -> int:
    return field_of(body, "n", int, 1, lo=1, hi=MAX_CHOICES)


def chat_logprobs_fields(body: dict) -> int | None:
    """Chat's `logprobs` / `top_logprobs` as SamplingParams.logprobs (None: none asked for)."""
    wanted = field_of(body, "logprobs", bool, False)
    top = field_of(body, "top_logprobs", int, lo=0, hi=MAX_TOP_LOGPROBS)
    if top is not None and not wanted:
        raise bad_request("'top_logprobs' needs 'logprobs': true", param="top_logprobs")
    return (top or 0) if wanted else None


def _tool_call_json(call: ToolCall, index: int | None = None) -> dict:
    out = {"id": f"call_{call.id}", "type": "function",
           "function": {"name": call.name, "arguments": call.arguments_json}}
    return out if index is None else {"index": index, **out}


def _finish_reason(final: FinishEvent, saw_call: bool) -> str:
    if saw_call:
        return "tool_calls"
    return "length" if final.finish_reason == "length" else "stop"


def tool_choice(choice, tools: list[dict] | None, nested: bool = True) -> tuple[list[dict] | None,
                                                                              Constraint | None]:
    """The tools a request's tool_choice leaves the model ('none': none; a named function must be one of them)
    and the tool calls it forces ('required', a named function) or makes exact (tools with strict: true).
    Chat names a function as {type: 'function', function: {name}}, the Responses API (`nested` False) as
    {type, name}."""
    if choice is None or choice in ("auto", "required"):
        return tools, tool_calls(tools, choice or "auto")
    if choice == "none":
        return None, None
    named = isinstance(choice, dict) and choice.get("type") == "function"
    fn = (choice.get("function") if nested else choice) if named else None
    if not isinstance(fn, dict):
        shape = "function: {name}" if nested else "name"
        raise bad_request(f"'tool_choice' must be 'none', 'auto', 'required' or {{type: 'function', {shape}}}",
                          param="tool_choice")
    check_choice(fn.get("name"), tools)
    return tools, tool_calls(tools, "named", fn["name"])


def stream_fields(body: dict) -> tuple[bool, bool]:
    """`stream`, and whether a stream ends with a usage chunk (stream_options.include_usage)."""
    stream = field_of(body, "stream", bool, False)
    return stream, bool(field_of(body, "stream_options", dict, {}).get("include_usage"))


def _chat_job(engine, body: dict, settings) -> Job:
    images: list[ImagePart] = []
    messages = template_messages(body.get("messages"), images)
    n, top = choices_field(body), chat_logprobs_fields(body)
    tools, calls = tool_choice(body.get("tool_choice"), check_tools(body.get("tools")))
    constraint = ordered(calls, response_format(body.get("response_format")))
    kwargs = template_kwargs(body)
    stream, include_usage = stream_fields(body)
    asked = field_of(body, "max_completion_tokens", int) or field_of(body, "max_tokens", int)
    params = replace(sampling(body, settings.sampling_defaults, stop_list(body.get("stop"), "stop")), logprobs=top)
    return chat_job(engine, params, messages, tools, kwargs, asked, settings.sampling_defaults.get("max_tokens", 512),
                    constraint, stream=stream, include_usage=include_usage, n=n,
                    images=ready_images(engine, images, settings, "messages"))


@router.post("/v1/chat/completions")
async def chat_completions(request: Request):
    body, job = await prepare(request, _chat_job)
    run = Run(request, job, "chat.completions")
    rid, created = f"chatcmpl-{uuid.uuid4().hex[:24]}", int(time.time())
    tokenizer = request.app.state.server.require_engine().tokenizer
    parsers = [OutputParser(job.in_reasoning, tools=job.tools or False) for _ in range(job.n)]

    def chunk(index: int, delta: dict, finish: str | None = None, logprobs: list[dict] | None = None) -> dict:
        lp = {"content": logprobs, "refusal": None} if logprobs else None
        return {"id": rid, "object": "chat.completion.chunk", "created": created, "model": body["model"],
                "choices": [{"index": index, "delta": delta, "logprobs": lp, "finish_reason": finish}]}

    if job.stream:
        async def events():
            for i in range(job.n):
                yield sse(chunk(i, {"role": "assistant", "content": ""}))
            calls = [0] * job.n
            unsent: list[list[dict]] = [[] for _ in range(job.n)]  # logprobs of tokens whose text is held back
            try:
                async for i, event in run.choices():
                    parser = parsers[i]
                    if isinstance(event, TokenEvent):
                        pieces = parser.feed(event.text)
                        if event.logprob is not None:
                            unsent[i] += chat_entries(tokenizer, [event.token_id], [event.logprob])
                    else:
                        pieces = parser.finish()
                    for p in pieces:
                        if p.kind == "text":
                            delta = {"content": p.text}
                        elif p.kind == "reasoning":
                            delta = {"reasoning_content": p.text, "reasoning": p.text}
                        else:
                            delta = {"tool_calls": [_tool_call_json(p.call, calls[i])]}
                            calls[i] += 1
                        yield sse(chunk(i, delta, logprobs=unsent[i]))
                        unsent[i] = []
                    if isinstance(event, FinishEvent):
                        yield sse(chunk(i, {}, _finish_reason(event, parser.saw_call), unsent[i]))
                if job.include_usage:
                    yield sse({"id": rid, "object": "chat.completion.chunk", "created": created,
                               "model": body["model"], "choices": [], "usage": usage(run.finals)})
            except Exception as exc:  # never a broken stream without a word: report in the API's error shape
                yield stream_error(exc)
            yield sse("[DONE]")

        return StreamingResponse(events(), media_type="text/event-stream", headers={"cache-control": "no-cache"})

    finals = await run.collect()
    return JSONResponse({
        "id": rid, "object": "chat.completion", "created": created, "model": body["model"],
        "choices": [_chat_choice(i, final, parser, tokenizer) for i, (final, parser) in enumerate(zip(finals, parsers,
                                                                                                       strict=True))],
        "usage": usage(finals),
    })


def _chat_choice(index: int, final: FinishEvent, parser: OutputParser, tokenizer) -> dict:
    reasoning, text, calls = [], [], []
    for p in parser.feed(final.text) + parser.finish():
        {"text": text, "reasoning": reasoning, "tool_call": calls}[p.kind].append(p)
    message: dict = {"role": "assistant", "content": "".join(p.text for p in text) or (None if calls else "")}
    if reasoning:
        message["reasoning_content"] = message["reasoning"] = "".join(p.text for p in reasoning)
    if calls:
        message["tool_calls"] = [_tool_call_json(p.call) for p in calls]
    logprobs = None
    if final.logprobs is not None:
        logprobs = {"content": chat_entries(tokenizer, final.token_ids, final.logprobs), "refusal": None}
    return {"index": index, "message": message, "logprobs": logprobs,
            "finish_reason": _finish_reason(final, bool(calls))}


def _completion_job(engine, body: dict, settings) -> Job:
    n = choices_field(body)
    unsupported(body, "best_of", off=(None, 1))
    unsupported(body, "echo", "suffix")
    top = field_of(body, "logprobs", int, lo=0, hi=MAX_TOP_LOGPROBS)  # 0: the chosen tokens' logprobs alone
    stream, include_usage = stream_fields(body)
    asked = field_of(body, "max_tokens", int, 16)
    params = replace(sampling(body, settings.sampling_defaults, stop_list(body.get("stop"), "stop")), logprobs=top)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if isinstance(prompt, str) and prompt:
        ids = encode_prompt(engine, prompt, "prompt")
    elif isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        ids = prompt
    else:
        raise bad_request("'prompt' must be a non-empty string or an array of token ids", param="prompt")
    return make_job(engine, ids, params, asked, 16, stream=stream, include_usage=include_usage, n=n)


@router.post("/v1/completions")
async def completions(request: Request):
    body, job = await prepare(request, _completion_job)
    run = Run(request, job, "completions")
    rid, created = f"cmpl-{uuid.uuid4().hex[:24]}", int(time.time())
    tokenizer = request.app.state.server.require_engine().tokenizer

    def choice(index: int, text: str, finish: str | None, logprobs: dict | None) -> dict:
        return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish}

    def body_of(choices: list[dict], finals: list[FinishEvent] | None = None) -> dict:
        out = {"id": rid, "object": "text_completion", "created": created, "model": body["model"], "choices": choices}
        if finals is not None:
            out["usage"] = usage(finals)
        return out

    def reason(final: FinishEvent) -> str:
        return "length" if final.finish_reason == "length" else "stop"

    if job.stream:
        async def events():
            unsent: list[list[TokenEvent]] = [[] for _ in range(job.n)]  # tokens whose text is held back
            offsets = [TextOffsets() for _ in range(job.n)]
            try:
                async for i, event in run.choices():
                    if isinstance(event, TokenEvent) and event.logprob is not None:
                        unsent[i].append(event)
                    if isinstance(event, TokenEvent) and not event.text:
                        continue
                    logprobs = None
                    if job.params.logprobs is not None:
                        tokens = unsent[i]
                        logprobs = completion_logprobs(tokenizer, [t.token_id for t in tokens],
                                                       [t.logprob for t in tokens], offsets[i])
                        unsent[i] = []
                    if isinstance(event, TokenEvent):
                        yield sse(body_of([choice(i, event.text, None, logprobs)]))
                    else:
                        yield sse(body_of([choice(i, "", reason(event), logprobs)]))
                if job.include_usage:
                    yield sse(body_of([], run.finals))
            except Exception as exc:
                yield stream_error(exc)
            yield sse("[DONE]")

        return StreamingResponse(events(), media_type="text/event-stream", headers={"cache-control": "no-cache"})
    finals = await run.collect()
    return JSONResponse(body_of([choice(i, f.text, reason(f), None if f.logprobs is None else
                                        completion_logprobs(tokenizer, f.token_ids, f.logprobs))
                                 for i, f in enumerate(finals)], finals))


@router.get("/v1/models")
async def models(request: Request):
    settings = request.app.state.server.settings
    created = int(request.app.state.server.started)
    return {"object": "list", "data": [{"id": name, "object": "model", "created": created, "owned_by": "ninfer"}
                                       for name in (settings.model_id, *settings.aliases)]}
