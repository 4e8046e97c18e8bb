"""Run a module's Triton kernels on CPU tensors through the Triton interpreter.

Whether ``triton.jit`` interprets is fixed when a kernel is decorated (``TRITON_INTERPRET`` at
import time). A module imported for the GPU therefore loads a second copy of itself with
``TRITON_INTERPRET=1`` when it is handed CPU tensors; this is that copy, made once per module.

Importing this module also mends one incompatibility of Triton 3.6's interpreter with NumPy >=
2.4 (:func:`mend_scalar_index`), so that kernels can loop ``for i in range(a, b)`` over runtime
scalars on the CPU as they do on the GPU.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from types import ModuleType

import torch

_COPIES: dict[str, ModuleType] = {}


def kernel_module(device: torch.device, module_name: str, module_file: str,
                  interpreting: bool) -> ModuleType:
    """The module whose Triton kernels serve tensors on ``device``: the module itself (imported
    as ``module_name``; ``interpreting``: its kernels were made by the interpreter) where its
    kernels fit, and its interpreted copy for CPU tensors in a compiled import."""
    if device.type == "cuda":
        if interpreting:
            raise RuntimeError(f"{module_name} was imported with TRITON_INTERPRET=1 (the Triton "
                               "interpreter) and cannot run on CUDA tensors; unset "
                               "TRITON_INTERPRET before importing it")
        return sys.modules[module_name]
    if device.type != "cpu":
        raise ValueError(f"the Triton kernels run on CUDA (or on the CPU through the Triton "
                         f"interpreter), got tensors on {device}")
    return sys.modules[module_name] if interpreting else interpreted_copy(module_name, module_file)


def mend_scalar_index() -> None:
    """Let ``range()`` take kernel scalars under the interpreter with NumPy >= 2.4.

    The interpreter holds a scalar as a 1-element array and converts it with
    ``int(array)``, which NumPy 2.4 refuses ("only 0-dimensional arrays can be converted to
    Python scalars", triton-lang/triton#9171, fixed upstream by squeezing the array first).
    This wraps the interpreter's tensor patching to convert ``int(array.squeeze())``, as the
    upstream fix does; it changes nothing for compiled kernels, and nothing where the
    interpreter is not built this way.
    """
    try:
        from triton.runtime import interpreter
    except ImportError:          # no interpreter in this Triton build
        return
    patch = getattr(interpreter, "_patch_lang_tensor", None)
    if patch is None or getattr(patch, "mends_scalar_index", False):
        return

    def patch_lang_tensor(tensor, scope):
        patch(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.squeeze()))

    patch_lang_tensor.mends_scalar_index = True
    interpreter._patch_lang_tensor = patch_lang_tensor


mend_scalar_index()


def same_mode(module: ModuleType) -> ModuleType:
    """``module`` (whose ``_interpreting()`` says whether its @jit functions were made by the
    interpreter) or its interpreted copy: the one whose @jit helpers a kernel module being
    imported now can call (an interpreted kernel cannot call compiled helpers)."""
    import triton
    if triton.knobs.runtime.interpret and not module._interpreting():
        return interpreted_copy(module.__name__, module.__file__)
    return module


def interpreted_copy(module_name: str, module_file: str) -> ModuleType:
    """The module at ``module_file`` loaded again with TRITON_INTERPRET=1 (cached; registered in
    ``sys.modules`` as ``<module_name>_interpreted`` while and after it loads, as an import
    would, so that e.g. its dataclasses resolve their annotations)."""
    if module_name not in _COPIES:
        spec = importlib.util.spec_from_file_location(module_name + "_interpreted", module_file)
        module = importlib.util.module_from_spec(spec)
        old = os.environ.get("TRITON_INTERPRET")
        os.environ["TRITON_INTERPRET"] = "1"
        sys.modules[spec.name] = module
        try:
            spec.loader.exec_module(module)
        except BaseException:
            del sys.modules[spec.name]
            raise
        finally:
            if old is None:
                del os.environ["TRITON_INTERPRET"]
            else:
                os.environ["TRITON_INTERPRET"] = old
        _COPIES[module_name] = module
    return _COPIES[module_name]
