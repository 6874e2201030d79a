"""From HTTP handlers to the engine: request checking (before anything is admitted), thread-to-asyncio event
streaming, disconnect watching, metrics, and the mapping of engine errors to API errors."""
from __future__ import annotations

import asyncio
import json
import logging
import math
import re
import threading
import time
from collections.abc import AsyncIterator, Callable
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from typing import Any

from starlette.concurrency import run_in_threadpool

from ..errors import ContextOverflowError, UserError
from ..runtime.request import SEED_RANGE, FinishEvent, SamplingParams, TokenEvent
from ..runtime.scheduler import Overloaded
from .constraints import Constraint
from .errors import ApiError, bad_request

_END = object()
log = logging.getLogger("ninfer.server")
RETRY_AFTER_S = 2
MAX_JSON_DEPTH = 64  # tool schemas nest a dozen levels; thousands only exhaust the parser's and templates' stacks
# A prompt's text may take this many bytes per token of max_context: real text takes about 4, so only a prompt far
# over the window is refused before it is tokenised (which costs memory and time in proportion to its bytes).
PROMPT_BYTES_PER_TOKEN = 32
RUNS = "ninfer.runs"  # the ASGI scope key of a request's runs, which the app's guard closes when the request ends
# Keys the server gives the chat template itself: a request's chat_template_kwargs may not replace them.
RESERVED_TEMPLATE_KEYS = frozenset({"messages", "tools", "add_generation_prompt", "bos_token", "eos_token",
                                    "raise_exception", "strftime_now"})


@dataclass
class ServerSettings:
    model_id: str  # the name /v1/models lists
    aliases: tuple[str, ...] = ()  # other names requests may use for the same model
    api_key: str | None = None
    max_body_bytes: int = 32 << 20
    sampling_defaults: dict[str, Any] = field(default_factory=dict)
    profile: str = ""
    cors_origins: tuple[str, ...] = ()
    host: str | None = None  # the bound address; on loopback, requests naming another host are refused
    any_model_name: bool = False  # answer whatever `model` a request names (one model is served anyway)
    image_urls: bool = False  # fetch the http(s) image URLs requests name (`images.py` says why it is off)
    image_urls_private: bool = False  # and those naming local or private addresses (`images.py`)

    def __post_init__(self) -> None:
        if self.api_key is not None and not self.api_key.strip():
            raise UserError("the API key is empty", hint="give a non-empty key, or none to serve without one")

    def check_model(self, name: Any) -> str:
        """The model name a request's answer carries; 404 for a name not served here."""
        if self.any_model_name and name in (None, ""):
            return self.model_id
        if not isinstance(name, str) or not name:
            raise bad_request("'model' is required and must be a string", param="model")
        if name not in (self.model_id, *self.aliases) and not self.any_model_name:
            raise ApiError(404, "not_found", f"model {name!r} is not served here; this server serves "
                           f"{self.model_id!r}", code="model_not_found", param="model")
        return name


def api_key_from(flag: str | None, env: str | None) -> str | None:
    """The server's key: --api-key, else $NINFER_API_KEY, else none (no auth). An empty one is an error, never a
    quiet 'no auth'."""
    key = flag if flag is not None else env
    if key is not None and not key.strip():
        where = "--api-key" if flag is not None else "NINFER_API_KEY"
        raise UserError(f"{where} is empty: an empty API key would turn authentication off",
                        hint="give a non-empty key, or leave out --api-key and unset NINFER_API_KEY to serve "
                        "without one")
    return key


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


def _no_constants(name: str) -> None:
    raise ValueError(f"{name} is not a JSON value (use a finite number)")


# Lone surrogates come only from \\u escapes (UTF-8 bytes cannot encode them): bodies without one skip the check.
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


def parse_json(raw: bytes) -> dict:
    """A request body as a JSON object: nesting bounded, every string valid Unicode, no NaN or Infinity."""
    try:
        body = json.loads(raw, parse_constant=_no_constants)
    except RecursionError:
        raise bad_request(f"the request body nests deeper than {MAX_JSON_DEPTH} levels") from None
    except ValueError as exc:
        raise bad_request(f"the request body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object")
    check_tree(body, texts=_SURROGATE_ESCAPE.search(raw) is not None)
    return body


def check_tree(body: dict, texts: bool = True) -> None:
    """Depth at most MAX_JSON_DEPTH (templates and encoders recurse); with `texts`, no lone UTF-16 surrogates
    (JSON escapes can make them; UTF-8 and the tokenizer cannot hold them). Iterative: no input exhausts the stack."""
    todo: list[tuple[dict | list, int, str]] = [(body, 1, "")]
    while todo:
        value, depth, where = todo.pop()
        if depth > MAX_JSON_DEPTH:
            raise bad_request(f"the request body nests deeper than {MAX_JSON_DEPTH} levels (at {where})")
        keyed = isinstance(value, dict)
        if not keyed and not texts:  # only the containers of an array matter; the types are gathered at C speed
            if not {dict, list}.isdisjoint(map(type, value)):
                todo.extend((v, depth + 1, f"{where}[{i}]") for i, v in enumerate(value) if type(v) in (dict, list))
            continue
        for k, v in value.items() if keyed else enumerate(value):
            if texts and keyed:
                _check_text(k, f"a key in {where or 'the body'}", where)
            if isinstance(v, (dict, list)):
                todo.append((v, depth + 1, _path(where, k)))
            elif texts and isinstance(v, str):
                _check_text(v, _path(where, k), _path(where, k))


def _path(where: str, key: str | int) -> str:
    return f"{where}[{key}]" if isinstance(key, int) else f"{where}.{key}" if where else key


def _check_text(text: str, where: str, path: str) -> None:
    if text.isascii():
        return
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise bad_request(f"{where}: the string holds a lone UTF-16 surrogate ({text[exc.start]!r} at character "
                          f"{exc.start}), which is not valid Unicode", param=path.split(".")[0].split("[")[0] or None
                          ) from None


def field_of(body: dict, key: str, kind: type | tuple, default: Any = None, *, required: bool = False,
             lo: float | None = None, hi: float | None = None) -> Any:
    """A checked field of a request body (bools are not numbers; ints pass as floats; floats are finite)."""
    if key not in body or body[key] is None:
        if required:
            raise bad_request(f"'{key}' is required", param=key)
        return default
    value = body[key]
    kinds = kind if isinstance(kind, tuple) else (kind,)
    if float in kinds and isinstance(value, int) and not isinstance(value, bool):
        try:
            value = float(value)
        except OverflowError:
            raise bad_request(f"'{key}' = {value} is out of range [{lo}, {hi}]", param=key) from None
    if not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds):
        names = "/".join(k.__name__ for k in kinds)
        raise bad_request(f"'{key}' must be of type {names}, got {type(value).__name__}", param=key)
    if isinstance(value, float) and not math.isfinite(value):
        raise bad_request(f"'{key}' must be a finite number, got {value}", param=key)
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


def unsupported(body: dict, *keys: str, off: tuple = (None, False, 0)) -> None:
    """400 for fields that ask for something this server does not do (answered, never silently ignored); `off`:
    the values that ask for nothing."""
    for key in keys:
        if body.get(key) not in off:
            raise bad_request(f"'{key}' is not supported by this server", param=key, code="unsupported_parameter")


def sampling(body: dict, defaults: dict, stop: tuple[str, ...], temp_max: float = 2.0) -> SamplingParams:
    """SamplingParams from the common body fields, checked before the prompt is made (SamplingParams itself rejects
    what is out of range); `make_job` sets max_tokens once the prompt's length is known."""
    return SamplingParams(
        temperature=field_of(body, "temperature", float, defaults.get("temperature", 0.7), lo=0, hi=temp_max),
        top_p=field_of(body, "top_p", float, defaults.get("top_p", 1.0), lo=0, hi=1),
        top_k=field_of(body, "top_k", int, defaults.get("top_k", 0), lo=0),
        min_p=field_of(body, "min_p", float, defaults.get("min_p", 0.0), lo=0, hi=0.999),
        repetition_penalty=field_of(body, "repetition_penalty", float, defaults.get("repeat_penalty", 1.0), lo=0.01),
        seed=field_of(body, "seed", int, lo=SEED_RANGE[0], hi=SEED_RANGE[1]), stop=stop,
        speculate=field_of(body, "speculate", bool, True),
        ignore_eos=field_of(body, "ignore_eos", bool, False),  # vLLM's extra field: benchmarks run to max_tokens
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


def template_kwargs(body: dict) -> dict:
    kwargs = field_of(body, "chat_template_kwargs", dict, {})
    reserved = sorted(RESERVED_TEMPLATE_KEYS & kwargs.keys())
    if reserved:
        raise bad_request(f"chat_template_kwargs may not set {', '.join(reserved)}: the server sets them from the "
                          "request itself", param="chat_template_kwargs")
    return dict(kwargs)


def encode_prompt(engine, text: str, param: str, images: list = ()) -> list[int]:
    """Tokenise a prompt (its videos' frames written out: `Engine.encode_rendered`), refusing first one too long to
    fit the window by its bytes alone."""
    limit = engine.max_context * PROMPT_BYTES_PER_TOKEN
    size = len(text) if text.isascii() else len(text.encode("utf-8"))
    if size > limit:
        raise ApiError(400, "invalid_request", f"the prompt is {size} bytes, over this server's limit of {limit} "
                       f"bytes ({PROMPT_BYTES_PER_TOKEN} a token of its {engine.max_context}-token context)",
                       code="context_length_exceeded", param=param)
    return engine.encode_rendered(text, images)


@dataclass
class Prepared:
    prompt_ids: list[int]
    in_reasoning: bool  # the prompt ends inside an open <think> block


def prepare_chat(engine, messages: list[dict], tools: list | None, kwargs: dict, images: list = ()) -> Prepared:
    # Qwen3.6 templates drop past turns' thinking unless told to keep it; keeping it makes turn N's tokens a
    # prefix of turn N+1's, so the held sequence serves the next request.
    kwargs = {"preserve_thinking": True, **kwargs}
    try:
        text = engine.render_chat(messages, tools, True, **kwargs)
    except (TypeError, ValueError, AttributeError, KeyError, IndexError) as exc:
        # the model's template is code run on the request's data (chat_template_kwargs of unexpected types...)
        raise bad_request(f"the chat template failed on this request: {type(exc).__name__}: {exc}") from None
    return Prepared(encode_prompt(engine, text, "messages", images), text.rstrip().endswith("<think>"))


def tool_names(tools: list[dict] | None) -> set[str]:
    return {t["function"]["name"] for t in tools or ()}


def check_choice(name: Any, tools: list[dict] | None, param: str = "tool_choice") -> None:
    """A tool_choice naming a tool must name one of the request's tools."""
    if not isinstance(name, str) or not name:
        raise bad_request(f"'{param}' must name a tool", param=param)
    if name not in tool_names(tools):
        known = ", ".join(sorted(tool_names(tools))) or "none"
        raise bad_request(f"'{param}' names the tool {name!r}, which is not among the request's tools ({known})",
                          param=param)


@dataclass
class Job:
    """A request ready to run: every field checked, the prompt tokenised, nothing admitted yet."""

    prompt_ids: list[int]
    params: SamplingParams
    stream: bool = False
    in_reasoning: bool = False
    tools: list[dict] | None = None
    include_usage: bool = False
    n: int = 1  # choices of the prompt, prefilled once (`Engine.submit_choices`)
    images: list = field(default_factory=list)  # the engine's images and videos, in the prompt's order
    embeds: Any = None  # the images' embeddings (`Engine.encode_images`): submit, on the event loop, runs no tower


def make_job(engine, prompt_ids: list[int], params: SamplingParams, asked: int | None, default: int,
             images: list = (), **rest) -> Job:
    """A Job whose max_tokens is its prompt's completion budget (see completion_budget), its images encoded once
    it is known to fit (a request refused for its length costs no tower run)."""
    budget = completion_budget(engine, engine.prompt_tokens(prompt_ids, images), asked, default)
    return Job(prompt_ids, replace(params, max_tokens=budget), images=list(images),
               embeds=engine.encode_images(images) if images else None, **rest)


def chat_job(engine, params: SamplingParams, messages: list[dict], tools: list[dict] | None, kwargs: dict,
             asked: int | None, default: int, constraint: Constraint | None = None, **rest) -> Job:
    """The Job of a chat request: its prompt rendered and tokenised, its budget set, its output constrained
    (a grammar after the reasoning when the prompt opens a <think> block)."""
    prep = prepare_chat(engine, messages, tools, kwargs, rest.get("images", ()))
    if constraint is not None:
        params = constraint.apply(engine, params, prep.in_reasoning)
    return make_job(engine, prep.prompt_ids, params, asked, default, in_reasoning=prep.in_reasoning, tools=tools,
                    **rest)


def _build(settings: ServerSettings, build: Callable, engine, raw: bytes) -> tuple[dict, Any]:
    body = parse_json(raw)
    body["model"] = settings.check_model(body.get("model"))  # the name answers carry
    with request_errors():
        return body, build(engine, body, settings)


async def prepare(request, build: Callable[..., Any]) -> tuple[dict, Any]:
    """The start every generation route shares: the loaded engine, then, off the event loop (parsing, templating
    and tokenising take time in proportion to the request), the body parsed, its model checked, and
    `build(engine, body, settings)` run with engine errors as API errors. Returns the body and what `build` made."""
    app = request.app.state.server
    engine = app.require_engine()
    raw = await app.read_body(request)
    return await run_in_threadpool(_build, app.settings, build, engine, raw)


class Run:
    """One admitted request, of one or several choices (`Job.n`). A worker thread per choice iterates its engine
    stream to the end (which gives back its slot and blocks) and hands the events to the event loop; a watch on
    the connection cancels them when the client goes away, queued or generating, streamed or not. The app's guard
    closes every run when its request's ASGI call ends, whatever the path (answered, failed after admission,
    client gone, server stopping): closing cancels, so the workers' ends come at once."""

    def __init__(self, request, job: Job, route: str) -> None:
        app = request.app.state.server
        self.metrics, self.route = app.metrics, route
        self.t0 = time.perf_counter()
        self.first_token_s: float | None = None
        self.finals: list[FinishEvent | None] = [None] * job.n
        self._working, self._working_lock = job.n, threading.Lock()  # choices whose worker has not ended
        self._loop = asyncio.get_running_loop()
        self._events: asyncio.Queue = asyncio.Queue()
        with request_errors():  # Overloaded / UserError at once
            self.streams = app.require_engine().submit_choices(job.prompt_ids, job.params, job.n, job.images,
                                                               job.embeds)
        try:
            for i, stream in enumerate(self.streams):
                threading.Thread(target=self._work, args=(i, stream), daemon=True, name="ninfer-request").start()
        except BaseException:
            self._cancel()
            raise
        request.scope[RUNS].append(self)
        self._watcher = self._loop.create_task(self._watch(request.receive))

    @property
    def final(self) -> FinishEvent | None:
        return self.finals[0]

    def _cancel(self) -> None:
        for stream in self.streams:
            stream.cancel()

    def close(self) -> None:
        self._cancel()
        self._watcher.cancel()

    async def _watch(self, receive) -> None:
        while (await receive())["type"] != "http.disconnect":
            pass
        self._cancel()

    def _put(self, item) -> None:
        try:
            self._loop.call_soon_threadsafe(self._events.put_nowait, item)
        except RuntimeError:  # the loop is gone (server shutting down)
            pass

    def _work(self, index: int, stream) -> None:
        try:
            for event in stream:
                if isinstance(event, TokenEvent) and self.first_token_s is None:
                    self.first_token_s = time.perf_counter() - self.t0
                elif isinstance(event, FinishEvent):
                    self.finals[index] = event
                    self._log(event)
                self._put((index, event))
        except BaseException as exc:  # delivered to the handler, which answers in the API's error shape
            self._put(exc)
        finally:
            with self._working_lock:
                self._working -= 1
                last = self._working == 0
            if last:  # here, so a request whose client left is counted too; before its end reaches the handler
                self._record([f for f in self.finals if f is not None])
            self._put(_END)

    async def choices(self) -> AsyncIterator[tuple[int, TokenEvent | FinishEvent]]:
        """Every choice's events as they come, with the choice's index; the first failure raises."""
        running = len(self.streams)
        try:
            while running:
                item = await self._events.get()
                if item is _END:
                    running -= 1
                elif isinstance(item, BaseException):
                    raise item
                else:
                    yield item
        finally:
            self._cancel()  # a reader that stops early wants no more

    async def events(self) -> AsyncIterator[TokenEvent | FinishEvent]:
        """The events of a run of one choice."""
        async for _, event in self.choices():
            yield event

    async def collect(self) -> list[FinishEvent]:
        """Every choice's FinishEvent, in order."""
        async for _ in self.choices():
            pass
        return self.finals

    def _log(self, final: FinishEvent) -> None:
        t = final.timings
        log.info("%s: prompt %d tokens (%d cached, %d prefilled, %.1f tok/s), %d generated (%.1f tok/s), %s",
                 self.route, final.prompt_tokens, final.cached_tokens, final.prompt_tokens - final.cached_tokens,
                 t.prefill_tok_s, final.completion_tokens, t.decode_tok_s, final.finish_reason)

    def _record(self, finals: list[FinishEvent]) -> None:
        """The run's metrics: one request however many choices it asked for (its status the first choice's end),
        its prompt once (the choices share its prefill), every choice's generated tokens, its decode rate the
        choices' mean."""
        if not finals:  # every choice failed: the handler answers with the error
            return
        first, m = finals[0], self.metrics
        m.requests.labels(self.route, first.finish_reason).inc()
        m.prompt_tokens.inc(first.prompt_tokens)
        m.cached_tokens.inc(first.cached_tokens)
        m.completion_tokens.inc(sum(f.completion_tokens for f in finals))
        if self.first_token_s is not None:
            m.ttft.observe(self.first_token_s)
        rates = [f.timings.decode_tok_s for f in finals if f.timings.decode_steps]
        if rates:
            m.decode_rate.observe(sum(rates) / len(rates))


def sse(data: dict | str, event: str | None = None) -> str:
    payload = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)
    return (f"event: {event}\n" if event else "") + f"data: {payload}\n\n"
