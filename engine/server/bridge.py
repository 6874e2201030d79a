"""From HTTP handlers to the engine: parse-independent request running, thread-to-asyncio event streaming,
metrics, and the mapping of engine errors to API errors."""
from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
from collections.abc import AsyncIterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from ..errors import ContextOverflowError, UserError
from ..runtime.request import FinishEvent, SamplingParams, TokenEvent
from ..runtime.scheduler import Overloaded
from .errors import ApiError, bad_request

_END = object()
log = logging.getLogger("ninfer.server")
RETRY_AFTER_S = 2


@dataclass
class ServerSettings:
    model_id: str  # the name /v1/models lists
    aliases: tuple[str, ...] = ()  # other names requests may use for the same model
    api_key: str | None = None
    max_body_bytes: int = 32 << 20
    sampling_defaults: dict[str, Any] = field(default_factory=dict)
    profile: str = ""
    cors_origins: tuple[str, ...] = ()

    def check_model(self, name: Any) -> None:
        if not isinstance(name, str) or not name:
            raise bad_request("'model' is required and must be a string", param="model")
        if name not in (self.model_id, *self.aliases):
            raise ApiError(404, "not_found", f"model {name!r} is not served here; this server serves "
                           f"{self.model_id!r}", code="model_not_found", param="model")


@contextmanager
def request_errors():
    """Engine exceptions a request caused become its API error; anything else stays an internal error."""
    try:
        yield
    except ApiError:
        raise
    except Exception as exc:
        raise engine_error(exc) from None


def engine_error(exc: Exception) -> ApiError:
    """An engine exception caused by a request -> its API error (the request's fault: 4xx)."""
    if isinstance(exc, Overloaded):
        return ApiError(429, "overloaded", str(exc), code="overloaded", retry_after=RETRY_AFTER_S)
    if isinstance(exc, ContextOverflowError):
        return ApiError(400, "invalid_request", str(exc), code="context_length_exceeded", param="messages")
    if isinstance(exc, UserError):
        return bad_request(str(exc))
    raise exc


def parse_json(raw: bytes) -> dict:
    try:
        body = json.loads(raw)
    except ValueError as exc:
        raise bad_request(f"the request body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object")
    return body


def field_of(body: dict, key: str, kind: type | tuple, default: Any = None, *, required: bool = False,
             lo: float | None = None, hi: float | None = None) -> Any:
    """A checked field of a request body (bools are not numbers; ints pass as floats)."""
    if key not in body or body[key] is None:
        if required:
            raise bad_request(f"'{key}' is required", param=key)
        return default
    value = body[key]
    kinds = kind if isinstance(kind, tuple) else (kind,)
    if float in kinds and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds):
        names = "/".join(k.__name__ for k in kinds)
        raise bad_request(f"'{key}' must be of type {names}, got {type(value).__name__}", param=key)
    if (lo is not None and value < lo) or (hi is not None and value > hi):
        raise bad_request(f"'{key}' = {value} is out of range [{lo}, {hi}]", param=key)
    return value


def stop_list(value: Any, key: str) -> tuple[str, ...]:
    if value is None:
        return ()
    if isinstance(value, str):
        return (value,)
    if isinstance(value, list) and all(isinstance(s, str) for s in value):
        return tuple(value)
    raise bad_request(f"'{key}' must be a string or a list of strings", param=key)


def sampling(body: dict, defaults: dict, max_tokens: int, stop: tuple[str, ...], temp_max: float = 2.0) -> \
        SamplingParams:
    """SamplingParams from the common body fields (SamplingParams itself rejects what is out of range)."""
    return SamplingParams(
        max_tokens=max_tokens,
        temperature=field_of(body, "temperature", float, defaults.get("temperature", 0.7), lo=0, hi=temp_max),
        top_p=field_of(body, "top_p", float, defaults.get("top_p", 1.0), lo=0, hi=1),
        top_k=field_of(body, "top_k", int, defaults.get("top_k", 0), lo=0),
        min_p=field_of(body, "min_p", float, defaults.get("min_p", 0.0), lo=0, hi=0.999),
        repetition_penalty=field_of(body, "repetition_penalty", float, defaults.get("repeat_penalty", 1.0), lo=0.01),
        seed=field_of(body, "seed", int), stop=stop, speculate=field_of(body, "speculate", bool, True),
    )


def completion_budget(engine, prompt_len: int, asked: int | None, default: int) -> int:
    """max_tokens for a request: what was asked (checked against the window), or the default cut to the room left."""
    if asked is not None:
        engine.check_fits(prompt_len, asked)
        return asked
    room = engine.max_context - prompt_len
    if room < 1:
        raise ContextOverflowError(prompt_len, 1, engine.max_context)
    return min(default, room)


@dataclass
class Prepared:
    prompt_ids: list[int]
    in_reasoning: bool  # the prompt ends inside an open <think> block


def prepare_chat(engine, messages: list[dict], tools: list | None, template_kwargs: dict) -> Prepared:
    # Qwen3.6 templates drop past turns' thinking unless told to keep it; keeping it makes turn N's tokens a
    # prefix of turn N+1's, so the held sequence serves the next request.
    template_kwargs = {"preserve_thinking": True, **template_kwargs}
    text = engine.render_chat(messages, tools, True, **template_kwargs)
    return Prepared(engine.tokenizer.encode(text, add_special=True), text.rstrip().endswith("<think>"))


class Run:
    """One admitted request's events as an async iterator; records metrics when it ends."""

    def __init__(self, engine, prompt_ids: list[int], params: SamplingParams, metrics, route: str) -> None:
        self.stream = engine.submit(prompt_ids, params)  # raises Overloaded / UserError at once
        self.metrics, self.route = metrics, route
        self.t0 = time.perf_counter()
        self.first_token_s: float | None = None
        self.final: FinishEvent | None = None

    async def events(self) -> AsyncIterator[TokenEvent | FinishEvent]:
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()

        def put(item) -> None:
            try:
                loop.call_soon_threadsafe(queue.put_nowait, item)
            except RuntimeError:  # the loop is gone (server shutting down)
                pass

        def worker() -> None:
            try:
                for event in self.stream:
                    if isinstance(event, TokenEvent) and self.first_token_s is None:
                        self.first_token_s = time.perf_counter() - self.t0
                    elif isinstance(event, FinishEvent):
                        self.final = event
                        self._record(event)  # here, so a request whose client left is counted too
                    put(event)
            except BaseException as exc:  # delivered to the handler, which answers in the API's error shape
                put(exc)
            finally:
                put(_END)

        threading.Thread(target=worker, daemon=True, name="ninfer-request").start()
        try:
            while True:
                item = await queue.get()
                if item is _END:
                    return
                if isinstance(item, BaseException):
                    raise item
                yield item
        finally:
            self.stream.cancel()

    def _record(self, final: FinishEvent) -> None:
        log.info("%s: prompt %d tokens (%d cached, %d prefilled), %d generated, %s", self.route, final.prompt_tokens,
                 final.cached_tokens, final.prompt_tokens - final.cached_tokens, final.completion_tokens,
                 final.finish_reason)
        m = self.metrics
        m.requests.labels(self.route, final.finish_reason).inc()
        m.prompt_tokens.inc(final.prompt_tokens)
        m.cached_tokens.inc(final.cached_tokens)
        m.completion_tokens.inc(final.completion_tokens)
        if self.first_token_s is not None:
            m.ttft.observe(self.first_token_s)
        if final.timings.decode_steps:
            m.decode_rate.observe(final.timings.decode_tok_s)


async def watch_disconnect(request, run: Run) -> None:
    """For non-streamed answers: cancel the generation as soon as the client goes away."""
    while True:
        if await request.is_disconnected():
            run.stream.cancel()
            return
        await asyncio.sleep(0.1)


async def collect(request, run: Run) -> FinishEvent:
    watcher = asyncio.create_task(watch_disconnect(request, run))
    try:
        async for _ in run.events():
            pass
    finally:
        watcher.cancel()
    return run.final


def sse(data: dict | str, event: str | None = None) -> str:
    payload = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)
    return (f"event: {event}\n" if event else "") + f"data: {payload}\n\n"
