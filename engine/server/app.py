"""The FastAPI application: routes of both APIs, auth, body limit, /health, /metrics, errors in each API's shape.
The engine loads in a background thread so /health can say "loading" meanwhile."""
from __future__ import annotations

import hmac
import threading
import time
from collections.abc import Callable
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..errors import NinferError
from . import anthropic_api, openai_api, responses_api
from .bridge import RETRY_AFTER_S, ServerSettings, parse_json
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

    async def begin(self, request: Request):
        """The start every generation route shares: the loaded engine and the parsed body, its model checked."""
        engine = self.require_engine()
        body = await self.read_body(request)
        self.settings.check_model(body.get("model"))
        return engine, body

    async def read_body(self, request: Request) -> dict:
        raw = await request.body()
        if len(raw) > self.settings.max_body_bytes:
            raise ApiError(413, "too_large", f"the request body ({len(raw)} bytes) is over the limit of "
                           f"{self.settings.max_body_bytes} bytes")
        return parse_json(raw)


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
    if settings.cors_origins:
        from fastapi.middleware.cors import CORSMiddleware

        app.add_middleware(CORSMiddleware, allow_origins=list(settings.cors_origins), allow_methods=["*"],
                           allow_headers=["*"])

    @app.middleware("http")
    async def guard(request: Request, call_next):
        request.state.server = state
        length = request.headers.get("content-length")
        if length and length.isdigit() and int(length) > settings.max_body_bytes:
            return error_response(ApiError(413, "too_large", f"the request body ({length} bytes) is over the "
                                           f"limit of {settings.max_body_bytes} bytes"), request.url.path)
        if settings.api_key and request.url.path not in OPEN_PATHS and request.method != "OPTIONS":
            given = request.headers.get("x-api-key") or ""
            auth = request.headers.get("authorization") or ""
            if auth.lower().startswith("bearer "):
                given = given or auth[7:].strip()
            if not hmac.compare_digest(given.encode(), settings.api_key.encode()):
                return error_response(ApiError(401, "authentication", "invalid or missing API key",
                                               code="invalid_api_key"), request.url.path)
        return await call_next(request)

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
    async def health():
        body = {"status": state.status, "model": settings.model_id, "profile": settings.profile,
                "uptime_s": round(time.time() - state.started, 1)}
        if state.error:
            body["error"] = state.error
        if state.engine is not None:
            body.update(state.engine.stats())
        return JSONResponse(body, status_code=200 if state.status == "ready" else 503)

    @app.get("/metrics")
    async def metrics():
        return PlainTextResponse(state.metrics.render(state.engine), media_type="text/plain; version=0.0.4")

    return app
