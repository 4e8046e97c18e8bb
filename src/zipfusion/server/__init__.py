"""OpenAI-compatible serving: ``zipfusion serve --model PATH`` (needs ``pip install 'zipfusion[server]'``)."""

from __future__ import annotations


def serve(model: str = "demo", host: str = "127.0.0.1", port: int = 8000, **engine_kwargs) -> None:
    """Load ``model`` into an engine and serve it over HTTP until interrupted."""
    try:
        import uvicorn
    except ImportError:
        raise ImportError("serving needs fastapi and uvicorn: pip install 'zipfusion[server]'") from None
    from ..engine import LLMEngine
    from .openai import create_app

    engine = LLMEngine(model, **engine_kwargs)
    uvicorn.run(create_app(engine), host=host, port=port, log_level="info")
