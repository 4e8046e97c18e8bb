"""The environment of the processes a benchmark starts (a server, a mode's worker) and what a
result records of this one's."""

from __future__ import annotations

import os
from pathlib import Path


def child_environment(**extra: str) -> dict[str, str]:
    """The environment of a process zipfusion starts (a server or a benchmark's worker): this
    one's, unbuffered, with this tree's src/ first on PYTHONPATH (the child imports the same code),
    and ``extra``."""
    src = str(Path(__file__).resolve().parents[2])
    path = os.pathsep.join(p for p in (src, os.environ.get("PYTHONPATH")) if p)
    return {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": path, **extra}


def zipfusion_variables() -> list[str]:
    """``NAME=value`` of every ZIPFUSION_* variable set: a result records what it ran under."""
    return [f"{k}={v}" for k, v in sorted(os.environ.items()) if k.startswith("ZIPFUSION_")]


def visible_gpus() -> list[str]:
    """CUDA_VISIBLE_DEVICES as a list (empty: every GPU is visible)."""
    return [d.strip() for d in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()]
