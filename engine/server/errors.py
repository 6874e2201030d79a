"""API errors, written in the shape of the API the request came to."""
from __future__ import annotations

from fastapi.responses import JSONResponse

# kind -> (OpenAI type, Anthropic type)
_TYPES = {
    "invalid_request": ("invalid_request_error", "invalid_request_error"),
    "authentication": ("invalid_request_error", "authentication_error"),
    "forbidden": ("invalid_request_error", "permission_error"),
    "not_found": ("invalid_request_error", "not_found_error"),
    "too_large": ("invalid_request_error", "request_too_large"),
    "overloaded": ("rate_limit_error", "overloaded_error"),
    "unavailable": ("server_error", "overloaded_error"),
    "server": ("server_error", "api_error"),
}


class ApiError(Exception):
    def __init__(self, status: int, kind: str, message: str, code: str | None = None, param: str | None = None,
                 retry_after: int | None = None) -> None:
        super().__init__(message)
        self.status, self.kind, self.message, self.code, self.param = status, kind, message, code, param
        self.retry_after = retry_after


def is_anthropic(path: str) -> bool:
    return path.startswith("/v1/messages")


def error_response(err: ApiError, path: str) -> JSONResponse:
    openai_type, anthropic_type = _TYPES[err.kind]
    # both may quote what a client sent: lone surrogates are escaped, since UTF-8 cannot carry them
    message, param = (None if t is None else t.encode("utf-8", "backslashreplace").decode("utf-8")
                      for t in (err.message, err.param))
    headers = {}
    if err.retry_after is not None:
        headers["retry-after"] = str(err.retry_after)
    elif err.status < 500:
        headers["x-should-retry"] = "false"  # the same request cannot succeed later
    if err.status == 413:
        headers["connection"] = "close"  # the rest of the body is never read: the connection cannot serve another
    if is_anthropic(path):
        status = 529 if err.kind in ("overloaded", "unavailable") else err.status
        body = {"type": "error", "error": {"type": anthropic_type, "message": message}}
    else:
        status = err.status
        body = {"error": {"message": message, "type": openai_type, "param": param, "code": err.code}}
    return JSONResponse(body, status_code=status, headers=headers)


def bad_request(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    return ApiError(400, "invalid_request", message, code=code, param=param)
