"""``api_key``: every /v1 route needs ``Authorization: Bearer KEY`` (401 otherwise); /health and
/metrics stay open, as in vLLM."""

from __future__ import annotations

import secrets

from .errors import error_response


class APIKeyMiddleware:
    """Pure ASGI (no BaseHTTPMiddleware: streaming and disconnects pass through untouched)."""

    def __init__(self, app, api_key: str):
        self.app, self.expected = app, f"Bearer {api_key}".encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"].startswith("/v1") and scope["method"] != "OPTIONS":
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not secrets.compare_digest(given, self.expected):
                response = error_response("invalid or missing API key: send 'Authorization: Bearer <key>'", 401,
                                          kind="invalid_request_error", headers={"WWW-Authenticate": "Bearer"},
                                          code="invalid_api_key")
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)
