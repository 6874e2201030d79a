"""The FastAPI application: routes of both APIs, the guard (Host/Origin checks, auth, body limit, the end of every
request's runs), /health, /metrics, errors in each API's shape.
The engine loads in a background thread so /health can say "loading" meanwhile."""
from __future__ import annotations

import hmac
import ipaddress
import threading
import time
from collections.abc import Callable
from contextlib import asynccontextmanager
from urllib.parse import urlsplit

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect
from starlette.types import ASGIApp, Receive, Scope, Send

from ..errors import NinferError
from . import anthropic_api, openai_api, responses_api
from .bridge import RETRY_AFTER_S, RUNS, ServerSettings
from .errors import ApiError, error_response
from .metrics import Metrics

OPEN_PATHS = ("/health", "/metrics")


class ServerState:
    """What handlers share: settings, metrics and the engine once it is loaded."""

    def __init__(self, settings: ServerSettings, load: Callable[[], object]) -> None:
        self.settings, self.metrics, self.started = settings, Metrics(), time.time()
        self.engine = None
        self.status, self.error = "loading", None
        self._load = load

    def load(self) -> None:
        try:
            self.engine = self._load()
            self.status = "ready"
        except NinferError as exc:
            self.status, self.error = "error", f"{exc}" + (f" ({exc.hint})" if exc.hint else "")
        except Exception as exc:  # reported by /health and the log; the process stays up to say so
            self.status, self.error = "error", f"{type(exc).__name__}: {exc}"

    def require_engine(self):
        if self.engine is None:
            what = "failed to load: " + self.error if self.status == "error" else "is still loading"
            raise ApiError(503, "unavailable", f"the model {what}", retry_after=None if self.error else
                           RETRY_AFTER_S)
        return self.engine

    async def read_body(self, request: Request) -> bytes:
        """The body, refused (413) as soon as it is over the limit, with or without a Content-Length."""
        limit, size, chunks = self.settings.max_body_bytes, 0, []
        try:
            async for chunk in request.stream():
                size += len(chunk)
                if size > limit:
                    raise ApiError(413, "too_large", f"the request body is over the limit of {limit} bytes")
                chunks.append(chunk)
        except ClientDisconnect:
            raise ApiError(400, "invalid_request", "the client went away before the request body was read") \
                from None
        return b"".join(chunks)


def is_loopback(host: str | None) -> bool:
    if not host:
        return False
    if host == "localhost" or host.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def _hostname(value: str) -> str | None:
    try:
        return urlsplit(value if "//" in value else "//" + value).hostname
    except ValueError:
        return None


class Guard:
    """The first stop of every HTTP request. Browser checks: on a loopback-bound server a request must name a
    loopback host (a foreign Host header is a DNS-rebinding page), and a request carrying an Origin must come
    from an allowed (--cors) or loopback origin, so no web page can make this server generate, even with a
    'simple' text/plain POST whose answer it cannot read. Then the declared body size and the API key. And it
    owns the runs a request starts: whatever way the request's call ends, they are closed, so their slots are
    given back."""

    def __init__(self, app: ASGIApp, settings: ServerSettings) -> None:
        self.app, self.settings = app, settings

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        refusal = self.check(scope)
        if refusal is not None:
            await error_response(refusal, scope["path"])(scope, receive, send)
            return
        runs = scope[RUNS] = []
        try:
            await self.app(scope, receive, send)
        finally:
            for run in runs:
                run.close()

    def check(self, scope: Scope) -> ApiError | None:
        s, headers, path = self.settings, Headers(scope=scope), scope["path"]
        host = headers.get("host")
        if is_loopback(s.host) and host is not None and not is_loopback(_hostname(host)):
            return ApiError(403, "forbidden", f"the Host header {host!r} does not name this server: a server on "
                            f"loopback answers requests to localhost or a loopback address only")
        origin = headers.get("origin")
        if origin is not None and origin not in s.cors_origins and "*" not in s.cors_origins and \
                not is_loopback(_hostname(origin)):
            return ApiError(403, "forbidden", f"requests from the web origin {origin!r} are not allowed (start the "
                            "server with --cors ORIGIN to allow one)")
        length = headers.get("content-length")
        if length and length.isdigit() and int(length) > s.max_body_bytes:
            return ApiError(413, "too_large", f"the request body ({length} bytes) is over the limit of "
                            f"{s.max_body_bytes} bytes")
        if path not in OPEN_PATHS and scope["method"] != "OPTIONS" and not authorized(s, headers):
            return ApiError(401, "authentication", "invalid or missing API key", code="invalid_api_key")
        return None


def authorized(settings: ServerSettings, headers: Headers) -> bool:
    if not settings.api_key:
        return True
    given = headers.get("x-api-key") or ""
    auth = headers.get("authorization") or ""
    if auth.lower().startswith("bearer "):
        given = given or auth[7:].strip()
    return hmac.compare_digest(given.encode(), settings.api_key.encode())


def create_app(settings: ServerSettings, load: Callable[[], object], load_in_background: bool = True) -> FastAPI:
    state = ServerState(settings, load)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        if load_in_background:
            threading.Thread(target=state.load, daemon=True, name="ninfer-load").start()
        else:
            state.load()
        yield

    app = FastAPI(title="ninfer", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.server = state
    for module in (openai_api, anthropic_api, responses_api):
        app.include_router(module.router)
    app.add_middleware(Guard, settings=settings)
    if settings.cors_origins:  # outside the guard, so its refusals to allowed origins carry CORS headers
        from fastapi.middleware.cors import CORSMiddleware

        app.add_middleware(CORSMiddleware, allow_origins=list(settings.cors_origins), allow_methods=["*"],
                           allow_headers=["*"])

    @app.exception_handler(ApiError)
    async def api_error(request: Request, exc: ApiError):
        return error_response(exc, request.url.path)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException):
        kind = "not_found" if exc.status_code == 404 else "invalid_request"
        message = f"no route {request.method} {request.url.path}" if exc.status_code in (404, 405) else \
            str(exc.detail)
        return error_response(ApiError(exc.status_code, kind, message), request.url.path)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError):
        return error_response(ApiError(400, "invalid_request", f"malformed request: {exc.errors()}"),
                              request.url.path)

    @app.exception_handler(Exception)
    async def internal_error(request: Request, exc: Exception):
        return error_response(ApiError(500, "server", f"internal error: {type(exc).__name__}: {exc}"),
                              request.url.path)

    @app.get("/health")
    async def health(request: Request):
        body = {"status": state.status, "model": settings.model_id, "profile": settings.profile,
                "uptime_s": round(time.time() - state.started, 1)}
        if state.error:  # a load error names files and paths: only for those who may use the server
            body["error"] = state.error if authorized(settings, request.headers) else \
                "the model failed to load (the server's log and an authenticated /health say why)"
        if state.engine is not None:
            body.update(state.engine.stats())
        return JSONResponse(body, status_code=200 if state.status == "ready" else 503)

    @app.get("/metrics")
    async def metrics():
        return PlainTextResponse(state.metrics.render(state.engine), media_type="text/plain; version=0.0.4")

    return app
