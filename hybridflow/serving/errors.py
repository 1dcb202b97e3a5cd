"""The server's error answers: OpenAI's error body, with ``param`` naming the field a client got
wrong, for pydantic's validation errors, ``SamplingParams``' and the engine's refusals, and
Starlette's own HTTP errors."""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

from hybridflow.serving.web import (
    FastAPI,
    JSONResponse,
    Request,
    RequestValidationError,
    StarletteHTTPException,
)


class ApiError(Exception):
    """An error answered with OpenAI's error body."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    def body(self) -> dict[str, Any]:
        kind = "invalid_request_error" if self.status < 500 else "server_error"
        return {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}}


_SAMPLING_FIELD = re.compile(r"SamplingParams\.(\w+)")
# Pydantic names union branches in error locations ("str", "list[int]"): not part of the field path.
_TYPE_TAGS = frozenset({"str", "int", "float", "bool", "dict", "list", "none"})


def _param_from_location(location: Sequence[int | str]) -> tuple[str | None, bool]:
    """The dotted field path of a pydantic error location, and whether it ran into a union branch."""
    parts: list[str] = []
    for part in location[1:] if location and location[0] == "body" else location:
        if isinstance(part, str) and ("[" in part or part in _TYPE_TAGS):
            return ".".join(parts) or None, True
        parts.append(str(part))
    return ".".join(parts) or None, False


def _validation_error(exc: RequestValidationError) -> ApiError:
    """A pydantic error as a 400 naming the field (the first error is enough to act on)."""
    first = exc.errors()[0]
    param, union = _param_from_location(first.get("loc", ()))
    message = str(first.get("msg", "invalid request"))
    if first.get("type") in ("extra_forbidden", "unexpected_keyword_argument"):
        message = "this server does not support this parameter"
    elif union:  # the first branch's complaint ("should be a valid string") would mislead
        message = "none of the accepted types matches this value (see docs/serving.md)"
    elif param and (named := _SAMPLING_FIELD.search(message)):
        param = f"{param}.{named.group(1)}"  # SamplingParams' own checks name the inner field
    return ApiError(400, f"{param}: {message}" if param else message, param)


def value_error(exc: ValueError, *, prefix: str = "", fallback: str | None = None) -> ApiError:
    """A ``SamplingParams`` or engine refusal as a 400, naming the sampling field its message names."""
    message = str(exc)
    named = _SAMPLING_FIELD.search(message)
    return ApiError(400, message, f"{prefix}{named.group(1)}" if named else fallback)


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def api_error(_: Request, exc: ApiError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status)

    @app.exception_handler(RequestValidationError)
    async def invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        error = _validation_error(exc)
        return JSONResponse(error.body(), status_code=error.status)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        return JSONResponse(ApiError(exc.status_code, str(exc.detail)).body(), status_code=exc.status_code)
