"""Run a module's Triton kernels on CPU tensors through the Triton interpreter.

Whether ``triton.jit`` interprets is fixed when a kernel is decorated (``TRITON_INTERPRET`` at
import time). A module imported for the GPU therefore loads a second copy of itself with
``TRITON_INTERPRET=1`` when it is handed CPU tensors; this is that copy, made once per module.
"""

from __future__ import annotations

import importlib.util
import os
from types import ModuleType

_COPIES: dict[str, ModuleType] = {}


def interpreted_copy(module_name: str, module_file: str) -> ModuleType:
    """The module at ``module_file`` loaded again with TRITON_INTERPRET=1 (cached)."""
    if module_name not in _COPIES:
        spec = importlib.util.spec_from_file_location(module_name + "_interpreted", module_file)
        module = importlib.util.module_from_spec(spec)
        old = os.environ.get("TRITON_INTERPRET")
        os.environ["TRITON_INTERPRET"] = "1"
        try:
            spec.loader.exec_module(module)
        finally:
            if old is None:
                del os.environ["TRITON_INTERPRET"]
            else:
                os.environ["TRITON_INTERPRET"] = old
        _COPIES[module_name] = module
    return _COPIES[module_name]
