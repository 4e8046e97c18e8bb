"""Run a module's Triton kernels on CPU tensors through the Triton interpreter: a module imported
for the GPU loads an interpreted copy of itself (once) when handed CPU tensors. Also mends Triton
3.6's interpreter for NumPy >= 2.4 (:func:`mend_scalar_index`).
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
    """The module whose kernels serve tensors on ``device``: itself, or its interpreted copy for
    CPU tensors in a compiled import."""
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
    """Let ``range()`` take kernel scalars under the interpreter with NumPy >= 2.4
    (triton-lang/triton#9171): ``int(array.squeeze())`` as the upstream fix does."""
    try:
        from triton.runtime import interpreter
    except ImportError:
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
    """``module`` or its interpreted copy: the one whose @jit helpers a kernel module being
    imported now can call."""
    import triton
    if triton.knobs.runtime.interpret and not module._interpreting():
        return interpreted_copy(module.__name__, module.__file__)
    return module


def interpreted_copy(module_name: str, module_file: str) -> ModuleType:
    """The module at ``module_file`` loaded again with TRITON_INTERPRET=1 (cached, registered in
    ``sys.modules`` as ``<module_name>_interpreted``)."""
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
