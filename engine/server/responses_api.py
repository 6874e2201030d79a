"""OpenAI Responses API: POST /v1/responses, streamed and not (Codex CLI speaks only this)."""
from __future__ import annotations

import itertools
import time
import uuid
from dataclasses import replace

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse

from ..runtime.request import MAX_TOP_LOGPROBS, FinishEvent, TokenEvent
from ..tokenizer.output_parser import OutputParser, ToolCall
from .bridge import (
    Job,
    Run,
    chat_job,
    field_of,
    prepare,
    sampling,
    sse,
    template_kwargs,
)
from .constraints import ordered, text_format
from .errors import bad_request
from .images import ImagePart, ready_images
from .logprobs import chat_entries
from .openai_api import text_of, tool_arguments, tool_choice

router = APIRouter()

LOGPROBS_INCLUDE = "message.output_text.logprobs"  # the `include` entry that asks for the output text's logprobs


def template_messages(body: dict, images: list[ImagePart] | None = None) -> list[dict]:
    """instructions + input items -> chat-template messages (function calls attach to the assistant turn); the
    user messages' `input_image` parts go to `images`."""
    out: list[dict] = []
    instructions = field_of(body, "instructions", str)
    if instructions:
        out.append({"role": "system", "content": instructions})
    items = body.get("input")
    if isinstance(items, str):
        items = [{"role": "user", "content": items}]
    if not isinstance(items, list) or not items:
        raise bad_request("'input' must be a non-empty string or array", param="input")
    pending_reasoning = ""

    def assistant() -> dict:
        nonlocal pending_reasoning
        if not out or out[-1]["role"] != "assistant":
            out.append({"role": "assistant", "content": ""})
        if pending_reasoning:
            out[-1]["reasoning_content"] = pending_reasoning
            pending_reasoning = ""
        return out[-1]

    for i, item in enumerate(items):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise bad_request(f"{where} must be an object", param="input")
        kind = item.get("type", "message")
        if kind == "message":
            role = {"developer": "system"}.get(item.get("role"), item.get("role"))
            if role not in ("system", "user", "assistant"):
                raise bad_request(f"{where}: unknown role {item.get('role')!r}", param="input")
            text = text_of(item.get("content"), where, "input", images if role == "user" else None)
            if role == "assistant":
                msg = assistant()
                msg["content"] += text
            elif role == "system" and out:  # templates take a system message only first
                out.append({"role": "user", "content": f"[system]\n{text}"})
            else:
                out.append({"role": role, "content": text})
        elif kind == "function_call":
            if not isinstance(item.get("name"), str):
                raise bad_request(f"{where}: function_call needs a name", param="input")
            msg = assistant()
            msg.setdefault("tool_calls", []).append({
                "id": item.get("call_id"), "type": "function",
                "function": {"name": item["name"], "arguments": tool_arguments(item.get("arguments", "{}"), where)}})
        elif kind == "function_call_output":
            output = item.get("output")
            out.append({"role": "tool", "content": output if isinstance(output, str) else text_of(output, where),
                        "tool_call_id": item.get("call_id")})
        elif kind == "reasoning":
            pending_reasoning += text_of(item.get("content") or item.get("summary") or [], where, "input")
        else:
            raise bad_request(f"{where}: input item type {kind!r} is not supported", param="input")
    return out


def function_tools(tools) -> list[dict] | None:
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise bad_request("'tools' must be an array", param="tools")
    out = []
    for t in tools:
        if isinstance(t, dict) and t.get("type") == "function" and isinstance(t.get("name"), str):
            fn = {"name": t["name"], "description": t.get("description", ""), "parameters": t.get("parameters") or {}}
            if t.get("strict") is True:  # its calls' arguments follow the schema exactly (a grammar)
                fn["strict"] = True
            out.append({"type": "function", "function": fn})
    return out or None


def _usage(final: FinishEvent | None) -> dict | None:
    if final is None:
        return None
    return {"input_tokens": final.prompt_tokens, "input_tokens_details": {"cached_tokens": final.cached_tokens},
            "output_tokens": final.completion_tokens, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": final.prompt_tokens + final.completion_tokens}


def _call_item(call: ToolCall, status: str = "completed") -> dict:
    return {"type": "function_call", "id": f"fc_{call.id}", "call_id": f"call_{call.id}", "name": call.name,
            "arguments": call.arguments_json, "status": status}


class _Builder:
    """Output items as they form; emits the Responses stream events for each change when `stream` (a whole
    response builds the items alone: no event's JSON, a delta's at every token, that it would throw away). An
    output_text part and its delta and done events always carry `logprobs` (the SDK's types require the events'
    list): empty unless the request included them."""

    def __init__(self, rid: str, model: str, created: int, top_logprobs: int | None, stream: bool = True) -> None:
        self.rid, self.model, self.created, self.top_logprobs = rid, model, created, top_logprobs
        self.stream = stream
        self.items: list[dict] = []
        self.open: dict | None = None
        self.seq = itertools.count()

    def response(self, status: str, final: FinishEvent | None = None) -> dict:
        incomplete = {"reason": "max_output_tokens"} if final is not None and final.finish_reason == "length" \
            else None
        return {"id": self.rid, "object": "response", "created_at": self.created, "status": status,
                "model": self.model, "output": self.items, "usage": _usage(final), "error": None,
                "incomplete_details": incomplete, "parallel_tool_calls": True, "tool_choice": "auto", "tools": [],
                "top_logprobs": self.top_logprobs}

    def event(self, kind: str, **fields) -> str:
        return sse({"type": kind, "sequence_number": next(self.seq), **fields}, kind)

    def _emit(self, out: list[str], kind: str, **fields) -> None:
        """`out` gains the event's stream line when the response is streamed."""
        if self.stream:
            out.append(self.event(kind, **fields))

    def _close(self) -> list[str]:
        if self.open is None:
            return []
        item, idx = self.open, len(self.items) - 1
        self.open = None
        out = []
        if item["type"] == "message":
            part = item["content"][0]
            self._emit(out, "response.output_text.done", item_id=item["id"], output_index=idx, content_index=0,
                       text=part["text"], logprobs=part["logprobs"])
            self._emit(out, "response.content_part.done", item_id=item["id"], output_index=idx,
                       content_index=0, part=part)
        else:
            text = item["content"][0]["text"]
            self._emit(out, "response.reasoning_text.done", item_id=item["id"], output_index=idx,
                       content_index=0, text=text)
        item["status"] = "completed"
        self._emit(out, "response.output_item.done", output_index=idx, item=item)
        return out

    def piece(self, kind: str, text: str = "", call: ToolCall | None = None,
              logprobs: list[dict] | None = None) -> list[str]:
        """`logprobs`: a text piece's tokens' entries (other pieces have none)."""
        out = []
        want = {"text": "message", "reasoning": "reasoning"}.get(kind)
        if self.open is not None and self.open["type"] != want:
            out += self._close()
        if kind == "tool_call":
            item = _call_item(call, "in_progress")
            self.items.append(item)
            idx = len(self.items) - 1
            self._emit(out, "response.output_item.added", output_index=idx, item={**item, "arguments": ""})
            self._emit(out, "response.function_call_arguments.delta", item_id=item["id"], output_index=idx,
                       delta=item["arguments"])
            self._emit(out, "response.function_call_arguments.done", item_id=item["id"], output_index=idx,
                       arguments=item["arguments"])
            item["status"] = "completed"
            self._emit(out, "response.output_item.done", output_index=idx, item=item)
            return out
        if self.open is None:
            if want == "message":
                item = {"type": "message", "id": f"msg_{uuid.uuid4().hex[:24]}", "status": "in_progress",
                        "role": "assistant", "content": [{"type": "output_text", "text": "", "annotations": [],
                                                          "logprobs": []}]}
            else:
                item = {"type": "reasoning", "id": f"rs_{uuid.uuid4().hex[:24]}", "status": "in_progress",
                        "summary": [], "content": [{"type": "reasoning_text", "text": ""}]}
            self.items.append(item)
            self.open = item
            idx = len(self.items) - 1
            self._emit(out, "response.output_item.added", output_index=idx,
                       item={**item, "content": [] if want == "message" else item["content"]})
            if want == "message":
                self._emit(out, "response.content_part.added", item_id=item["id"], output_index=idx,
                           content_index=0, part={"type": "output_text", "text": "", "annotations": [],
                                                  "logprobs": []})
        idx = len(self.items) - 1
        part = self.open["content"][0]
        part["text"] += text
        if want == "message":
            part["logprobs"] += logprobs or []
            self._emit(out, "response.output_text.delta", item_id=self.open["id"], output_index=idx,
                       content_index=0, delta=text, logprobs=logprobs or [])
        else:
            self._emit(out, "response.reasoning_text.delta", item_id=self.open["id"], output_index=idx,
                       content_index=0, delta=text)
        return out

    def finish(self) -> list[str]:
        return self._close()


class OutputReader:
    """A run's events as the builder's output items (and stream lines), each output-text token's logprob entry
    with the text it makes. A token is output text when the parser reads text both before and after it (reasoning,
    tool calls and the tags between them are not) and its text is not whitespace the parser strips where text
    begins (the blank lines after `</think>` or a call)."""

    def __init__(self, builder: _Builder, parser: OutputParser, tokenizer) -> None:
        self.builder, self.parser, self.tokenizer = builder, parser, tokenizer
        self.unsent: list[dict] = []  # entries of output-text tokens whose text the parser holds back

    def _began(self) -> bool:
        """Whether the current text has begun: a message has text, or tokens of it wait."""
        item = self.builder.open
        return bool(self.unsent) or item is not None and item["type"] == "message" and bool(item["content"][0]["text"])

    def feed(self, event: TokenEvent | FinishEvent) -> list[str]:
        if isinstance(event, FinishEvent):
            pieces = self.parser.finish()
        else:
            was, began = self.parser.mode, self._began()
            pieces = self.parser.feed(event.text)
            if event.logprob is not None and was == self.parser.mode == "text" and (began or not event.text.isspace()):
                self.unsent += chat_entries(self.tokenizer, [event.token_id], [event.logprob])
        out = []
        for p in pieces:
            # text held when a call or reasoning began was whitespace the parser dropped: so are its logprobs
            taken = self.unsent if p.kind == "text" else []
            self.unsent = []
            out += self.builder.piece(p.kind, p.text, p.call, taken)
        return out

    def whole(self, final: FinishEvent) -> None:
        """A finished run's output at once, where no token has a logprob to place: its text parsed in one piece
        (the parser's items are the same whichever way the text comes in)."""
        for p in self.parser.feed(final.text) + self.parser.finish():
            self.builder.piece(p.kind, p.text, p.call)


def _job(engine, body: dict, settings) -> Job:
    if body.get("previous_response_id"):
        raise bad_request("previous_response_id is not supported: send the whole conversation in 'input' "
                          "(store = false)", param="previous_response_id")
    include = body.get("include") or []
    if not isinstance(include, list) or any(not isinstance(i, str) for i in include):
        raise bad_request("'include' must be an array of strings", param="include")
    # as OpenAI's: `include` asks for logprobs, top_logprobs says how many alternatives (alone it asks for none)
    top = field_of(body, "top_logprobs", int, lo=0, hi=MAX_TOP_LOGPROBS)
    stream = field_of(body, "stream", bool, False)
    asked = field_of(body, "max_output_tokens", int, lo=1)
    params = replace(sampling(body, settings.sampling_defaults, ()),
                     logprobs=(top or 0) if LOGPROBS_INCLUDE in include else None)
    images: list[ImagePart] = []
    messages = template_messages(body, images)
    tools, calls = tool_choice(body.get("tool_choice"), function_tools(body.get("tools")), nested=False)
    constraint = ordered(calls, text_format(body.get("text")))
    return chat_job(engine, params, messages, tools, template_kwargs(body), asked,
                    settings.sampling_defaults.get("max_tokens", 512), constraint, stream=stream,
                    images=ready_images(engine, images, settings, "input"))


@router.post("/v1/responses")
async def responses(request: Request):
    body, job = await prepare(request, _job)
    run = Run(request, job, "responses")
    b = _Builder(f"resp_{uuid.uuid4().hex[:24]}", body["model"], int(time.time()), body.get("top_logprobs"),
                 job.stream)
    reader = OutputReader(b, OutputParser(job.in_reasoning, tools=job.tools or False),
                          request.app.state.server.require_engine().tokenizer)

    if job.stream:
        async def events():
            yield b.event("response.created", response=b.response("in_progress"))
            yield b.event("response.in_progress", response=b.response("in_progress"))
            try:
                async for event in run.events():
                    for line in reader.feed(event):
                        yield line
                    if isinstance(event, FinishEvent):
                        for line in b.finish():
                            yield line
                        status = "incomplete" if event.finish_reason == "length" else "completed"
                        yield b.event(f"response.{status}", response=b.response(status, event))
            except Exception as exc:  # the stream ends with a failure event, never mid-air
                failed = {**b.response("failed"), "error": {"code": "server_error", "message": str(exc)}}
                yield b.event("response.failed", response=failed)

        return StreamingResponse(events(), media_type="text/event-stream", headers={"cache-control": "no-cache"})

    if job.params.logprobs is None:
        final = (await run.collect())[0]
        reader.whole(final)
    else:  # token by token as a stream is, so that each token's logprob lands where its text does
        async for event in run.events():
            reader.feed(event)
        final = run.final
    b.finish()
    status = "incomplete" if final.finish_reason == "length" else "completed"
    return JSONResponse(b.response(status, final))
