"""docs/design.md names only modules, files and entry points that exist (as test_readme.py keeps
the README in step)."""

import importlib
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT / "src" / "zipfusion"
TEXT = (ROOT / "docs" / "design.md").read_text()
LAYERS = ("format", "kernels", "memory", "models", "attention", "engine", "distributed", "server", "analysis")


def layer_block_files():
    """(layer, file) for every ``name.py`` in the layer list, under the layer it describes."""
    block = TEXT.split("## Layers", 1)[1].split("```", 2)[1]
    layer, out = None, []
    for line in block.splitlines():
        first = re.match(r"(\S+)\s", line)
        if first and first.group(1).endswith("/"):          # a layer's first line
            layer = first.group(1)[:-1]
        elif first and first.group(1).endswith(".py"):      # a top-level module
            layer = ""
        out += [(layer, name) for name in re.findall(r"\b[\w/]+\.(?:py|cu)\b", line)]
    return out


def file_paths():
    """Every path with a slash that design.md names (``attention/backend.py``, ``benchmarks/seal.py``)."""
    return sorted(set(re.findall(r"\b[\w.]+/[\w./]*\w\.(?:py|cu|md|sh)\b", TEXT)))


def dotted_names():
    """Every ``format.x.y`` / ``kernels.x`` ... entry point design.md names."""
    pattern = r"`(?:zipfusion\.)?((?:%s)\.[\w.]*\w)" % "|".join(LAYERS)
    return sorted(set(re.findall(pattern, TEXT)))


def test_design_names_things():
    assert len(layer_block_files()) > 20 and len(file_paths()) > 15 and len(dotted_names()) > 10


@pytest.mark.parametrize("layer,name", layer_block_files())
def test_layer_list_files_exist(layer, name):
    assert (PKG / layer / name).exists(), f"design.md's layer list names {layer}/{name}"


@pytest.mark.parametrize("path", file_paths())
def test_named_files_exist(path):
    where = [ROOT / path, PKG / path, ROOT / "docs" / path]
    assert any(p.exists() for p in where), f"design.md names {path}, which is not in the repository"


@pytest.mark.parametrize("name", dotted_names())
def test_named_entry_points_exist(name):
    parts = name.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module("zipfusion." + ".".join(parts[:i]))
        except ModuleNotFoundError:
            continue
        for attr in parts[i:]:
            assert hasattr(obj, attr), f"design.md names zipfusion.{name}: no {attr!r}"
            obj = getattr(obj, attr)
        return
    pytest.fail(f"design.md names zipfusion.{name}, which does not import")


def package_imports():
    """(package, imported package, module) for every relative import of one package from another."""
    import ast
    for f in PKG.rglob("*.py"):
        rel = f.relative_to(PKG).parts
        if len(rel) == 1:
            continue                                    # top-level modules (config.py, cli.py ...)
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level > 1 and node.module:
                base = list(rel[:-1])[:len(rel) - node.level]
                target = (base + node.module.split("."))
                if target[0] != rel[0] and (PKG / target[0]).is_dir():
                    yield rel[0], target[0], ".".join(target)


def test_each_layer_imports_only_the_layers_above_it():
    """The layer list's order is the import order: a package imports only packages listed above
    it (the one exception: format's Triton codec runs through kernels/triton_interpreter.py,
    which imports nothing of zipfusion)."""
    block = TEXT.split("## Layers", 1)[1].split("```", 2)[1]
    order = [m.group(1) for m in re.finditer(r"^(\w+)/\s", block, re.M)]
    assert {"format", "kernels", "memory", "attention", "engine"} <= set(order)
    wrong = sorted({(a, m) for a, b, m in package_imports()
                    if a in order and b in order and order.index(b) > order.index(a)
                    and m != "kernels.triton_interpreter"})
    assert not wrong, f"imports of a layer listed below: {wrong}"
