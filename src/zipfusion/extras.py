"""The optional packages a command needs (pyproject's extras), checked before it starts."""

from __future__ import annotations

import importlib


def install_hint(extra: str) -> str:
    """How to install an extra, as the README installs zipfusion: editable, from the checkout
    (``zipfusion`` is not a package on the public index: a name anyone could register there)."""
    return f"from the zipfusion checkout: pip install -e '.[{extra}]'"


def require(modules: tuple[str, ...], extra: str, what: str) -> None:
    """Import ``modules`` now, or fail in one line saying what to pip install."""
    for name in modules:
        try:
            importlib.import_module(name)
        except ImportError:
            raise ImportError(f"{what} needs {name}, which is not installed; {install_hint(extra)}") from None
