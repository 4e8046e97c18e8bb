"""Every error in OpenAI's shape, ``{"error": {"message", "type", "param", "code"}}``, 404 and 405
included; refusals count in ``zipfusion:requests_rejected``.
"""

from __future__ import annotations

import json
import logging

from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from .metrics import Metrics
from .protocol import BadRequest

log = logging.getLogger("zipfusion.server")

ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "invalid_request_error",
               405: "invalid_request_error", 413: "invalid_request_error", 500: "server_error"}


class ErrorJSONResponse(JSONResponse):
    """ASCII JSON, so a message quoting the client's text (a lone surrogate) always encodes."""

    def render(self, content) -> bytes:
        return json.dumps(content, ensure_ascii=True, separators=(",", ":")).encode("ascii")


def error_body(message: str, status: int = 400, param: str | None = None, kind: str | None = None,
               code: str | None = None) -> dict:
    return {"error": {"message": message, "type": kind or ERROR_TYPES.get(status, "invalid_request_error"),
                      "param": param, "code": code}}


def error_response(message: str, status: int = 400, param: str | None = None, kind: str | None = None,
                   headers: dict | None = None, code: str | None = None) -> JSONResponse:
    return ErrorJSONResponse(error_body(message, status, param, kind, code), status_code=status, headers=headers)


def validation_error(exc: RequestValidationError) -> JSONResponse:
    """pydantic's complaints as one message; a field nobody implements is named as such."""
    parts, param = [], None
    errors = exc.errors()
    for e in errors[:4]:
        if e["type"] == "json_invalid":          # loc: ("body", character offset)
            where = e["loc"][1] if len(e["loc"]) > 1 else "?"
            why = (e.get("ctx") or {}).get("error", e["msg"])
            return error_response(f"the body is not valid JSON ({why}; character {where}); send a JSON object")
        if e["type"] == "invalid_text":           # a lone surrogate: name where, not "body"
            where = (e.get("ctx") or {}).get("where", "body")
            return error_response(e["msg"], param=where.split(".")[0].split("[")[0])
        if e["type"] in ("model_type", "model_attributes_type", "dict_type") and len(e["loc"]) <= 1:
            return error_response("the body must be a JSON object (of the fields this route takes)")
        loc = ".".join(str(p) for p in e["loc"][1:]) or "body"
        param = param or loc
        if e["type"] == "extra_forbidden":
            parts.append(f"unsupported field {loc!r} (not implemented by this server)")
        elif e["type"] == "missing":
            parts.append(f"{loc}: a required field is missing")
        else:
            parts.append(f"{loc}: {e['msg']}")
    more = f" (and {len(errors) - 4} more)" if len(errors) > 4 else ""
    return error_response(f"malformed request: {'; '.join(parts)}{more}", param=param)


def install_error_handlers(app: FastAPI, metrics: Metrics) -> None:
    @app.exception_handler(RequestValidationError)
    async def _invalid(_, exc: RequestValidationError):
        metrics.rejected.inc()
        return validation_error(exc)

    @app.exception_handler(BadRequest)
    async def _bad(_, exc: BadRequest):
        metrics.rejected.inc()
        return error_response(str(exc), exc.status, exc.param, code=exc.code)

    @app.exception_handler(StarletteHTTPException)
    async def _http(_, exc: StarletteHTTPException):
        message = str(exc.detail)
        if exc.status_code == 400 and "parsing the body" in message:  # FastAPI's: not UTF-8, not JSON
            metrics.rejected.inc()
            message = "the body could not be read as JSON text (it must be UTF-8 encoded JSON)"
        return error_response(message, exc.status_code, headers=getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def _crash(_, exc: Exception):
        log.exception("request failed")
        return error_response(f"internal error: {type(exc).__name__}: {exc}", 500)
