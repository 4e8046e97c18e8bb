"""OpenAI-compatible serving: ``zipfusion serve --model PATH`` (the ``server`` extra). Importing
this package imports neither fastapi nor torch; :func:`serve` does.
"""

from __future__ import annotations

import logging
import socket
import sys

log = logging.getLogger("zipfusion.server")


def bind_socket(host: str, port: int) -> socket.socket:
    """A socket bound to (host, port) for uvicorn: a busy port fails here, before the model loads."""
    if not 0 <= port <= 65535:
        raise ValueError(f"--port must be in 0..65535, got {port}")
    try:
        info = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as exc:
        raise ValueError(f"cannot listen on {host!r}: {exc.strerror}") from None
    family, kind, proto, _, addr = info[0]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn: not blocked by TIME_WAIT
    try:
        sock.bind(addr)
    except OSError as exc:
        sock.close()
        why = "is already in use" if exc.errno in (98, 48, 10048) else f"cannot be bound ({exc.strerror})"
        raise ValueError(f"port {port} on {host} {why}; stop what holds it or pick another --port") from None
    sock.set_inheritable(True)
    return sock


class _StderrHandler(logging.StreamHandler):
    """Writes to whatever sys.stderr is at the time of each record (not the one at set-up)."""

    @property
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, _value):
        pass


def configure_logging(level: str = "info") -> None:
    """Show the engine's ``zipfusion`` log lines (the start-up line) beside uvicorn's."""
    logger = logging.getLogger("zipfusion")
    logger.setLevel(level.upper())
    if not logger.handlers and not logging.getLogger().handlers:  # logging not set up by the host program
        handler = _StderrHandler()
        handler.setFormatter(logging.Formatter("%(levelname)s %(asctime)s %(name)s: %(message)s", "%H:%M:%S"))
        logger.addHandler(handler)


SERVER_EXTRA_HINT = "from the zipfusion checkout: pip install -e '.[server]'"


def serve(model="demo", host: str = "127.0.0.1", port: int = 8000, *, sock: socket.socket | None = None,
          api_key: str | None = None, served_model_name: str | list[str] | None = None, log_level: str = "info",
          default_max_tokens: int = 256, limits=None, metrics_prefix: str = "zipfusion", **engine_kwargs) -> None:
    """Load ``model`` (a name or an :class:`~zipfusion.config.EngineConfig`) and serve it over HTTP
    until interrupted; a name gets the device's serving chunk budget."""
    try:
        import uvicorn
    except ImportError:
        raise ImportError(f"serving needs fastapi and uvicorn: {SERVER_EXTRA_HINT}") from None
    configure_logging(log_level)
    if sock is None:
        sock = bind_socket(host, port)
    try:
        from ..config import EngineConfig, serving_max_num_batched_tokens
        from ..engine import LLMEngine
        from .openai import create_app

        if not isinstance(model, EngineConfig) and engine_kwargs.get("max_num_batched_tokens") is None:
            device = engine_kwargs.get("device", "auto")
            engine_kwargs["max_num_batched_tokens"] = serving_max_num_batched_tokens(device)
        engine = LLMEngine(model) if isinstance(model, EngineConfig) else LLMEngine(model, **engine_kwargs)
        if engine.device.type == "cuda":
            engine.warm_up()  # the largest step's memory taken now, not under load
        app = create_app(engine, served_model_name, default_max_tokens=default_max_tokens, api_key=api_key,
                         limits=limits, metrics_prefix=metrics_prefix)
        bound = sock.getsockname()
        lim = app.state.limits
        log.info("serving %s on http://%s:%d (KV: %d free pages of 16 tokens, max_model_len %d, prefill chunks "
                 "of %d tokens, at most %d sequences and %d bytes a request%s)",
                 app.state.model_names[0], bound[0], bound[1], engine.cache.capacity_new_pages(),
                 engine.max_model_len, engine.config.max_num_batched_tokens, lim.max_sequences,
                 lim.max_request_bytes, ", API key required" if api_key else "")
        server = uvicorn.Server(uvicorn.Config(app, log_level=log_level, timeout_graceful_shutdown=5))
        server.run(sockets=[sock])
    finally:
        sock.close()
