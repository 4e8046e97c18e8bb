"""zipfusion: LLM inference with a losslessly compressed BF16 KV cache. Importing the package is
cheap (no torch): ``LLM``, ``SamplingParams`` and the rest load on first use."""

from __future__ import annotations

import importlib

__version__ = "0.1.0"

# public name -> the module that defines it, imported on first access
_LAZY = {
    "LLM": ".engine",
    "LLMEngine": ".engine",
    "SamplingParams": ".engine",
    "RequestOutput": ".engine",
    "CompletionOutput": ".engine",
    "EngineConfig": ".config",
}

__all__ = ["LLM", "LLMEngine", "SamplingParams", "RequestOutput", "CompletionOutput", "EngineConfig",
           "__version__"]


def __getattr__(name: str):
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name], __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'zipfusion' has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(_LAZY))
