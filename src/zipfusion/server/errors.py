"""Every error in OpenAI's shape: ``{"error": {"message", "type", "param", "code"}}``.

404 and 405 included (FastAPI's own ``{"detail"}`` never reaches a client); a request refused
before it reaches the engine counts in ``zipfusion:requests_rejected``.
"""

from __future__ import annotations

import logging

from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from .metrics import Metrics
from .protocol import BadRequest

log = logging.getLogger("zipfusion.server")

ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
               405: "invalid_request_error", 500: "server_error"}


def error_body(message: str, status: int = 400, param: str | None = None, kind: str | None = None) -> dict:
    return {"error": {"message": message, "type": kind or ERROR_TYPES.get(status, "invalid_request_error"),
                      "param": param, "code": status}}


def error_response(message: str, status: int = 400, param: str | None = None, kind: str | None = None,
                   headers: dict | None = None) -> JSONResponse:
    return JSONResponse(error_body(message, status, param, kind), status_code=status, headers=headers)


def validation_error(exc: RequestValidationError) -> JSONResponse:
    """pydantic's complaints as one message; a field nobody implements is named as such."""
    parts, param = [], None
    for e in exc.errors():
        loc = ".".join(str(p) for p in e["loc"][1:]) or "body"
        param = param or loc
        if e["type"] == "extra_forbidden":
            parts.append(f"unsupported field {loc!r} (not implemented by this server)")
        else:
            parts.append(f"{loc}: {e['msg']}")
    return error_response(f"malformed request: {'; '.join(parts)}", param=param)


def install_error_handlers(app: FastAPI, metrics: Metrics) -> None:
    @app.exception_handler(RequestValidationError)
    async def _invalid(_, exc: RequestValidationError):
        metrics.rejected.inc()
        return validation_error(exc)

    @app.exception_handler(BadRequest)
    async def _bad(_, exc: BadRequest):
        metrics.rejected.inc()
        return error_response(str(exc), exc.status, exc.param)

    @app.exception_handler(StarletteHTTPException)
    async def _http(_, exc: StarletteHTTPException):
        return error_response(str(exc.detail), exc.status_code, headers=getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def _crash(_, exc: Exception):
        log.exception("request failed")
        return error_response(f"internal error: {type(exc).__name__}: {exc}", 500)
