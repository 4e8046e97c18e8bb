"""docs/benchmarks.md and the README name only files that exist, and benchmarks/results/ stays a
short record (as test_design.py keeps docs/design.md in step)."""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
DOCS = ("docs/benchmarks.md", "README.md")
MAX_RESULTS_ENTRIES = 30

# a repository path anywhere in the text: benchmarks/..., docs/..., scripts/..., src/... (also ../ links)
ROOTED = re.compile(r"(?<![\w./-])(?:\.\./)?((?:benchmarks|docs|scripts|src)/[\w./-]*[\w/])")
# a path in backticks with no space: `kernel_h100/diag/full/attention_quick.json` (under benchmarks/results/)
QUOTED = re.compile(r"`([\w.-]+/[\w./-]*)`")


def named_paths(text: str) -> list[str]:
    """Every path the text names: rooted ones, and backticked ones (read relative to the root,
    benchmarks/results/, docs/ or the package)."""
    found = {m.group(1) for m in ROOTED.finditer(text)}
    found |= {m.group(1) for m in QUOTED.finditer(text) if not m.group(1).startswith(("http", "-"))}
    return sorted(p.rstrip(".") for p in found)


def missing(paths: list[str]) -> list[str]:
    bases = (ROOT, RESULTS, ROOT / "docs", ROOT / "src" / "zipfusion")
    return [p for p in paths if not any((b / p).exists() for b in bases)]


def test_the_path_finder_finds_and_flags():
    text = ("`kernel_h100/diag.png` and benchmarks/results/serve_h100/README.md, "
            "[x](../benchmarks/results/no_such_folder/a.json), `nowhere/x.json`, `zipfusion bench serve`")
    paths = named_paths(text)
    assert "kernel_h100/diag.png" in paths and "benchmarks/results/serve_h100/README.md" in paths
    assert missing(paths) == ["benchmarks/results/no_such_folder/a.json", "nowhere/x.json"]


@pytest.mark.parametrize("doc", DOCS)
def test_doc_names_files(doc):
    assert len(named_paths((ROOT / doc).read_text())) >= 5, f"{doc} names almost no files: the finder broke?"


@pytest.mark.parametrize("doc", DOCS)
def test_every_named_path_exists(doc):
    gone = missing(named_paths((ROOT / doc).read_text()))
    assert not gone, f"{doc} names files that are not in the repository: {gone}"


def test_benchmarks_doc_is_short():
    lines = (ROOT / "docs" / "benchmarks.md").read_text().count("\n")
    assert lines <= 420, f"docs/benchmarks.md has {lines} lines (the record a reader wants: ~400 at most)"


def test_results_folder_is_short():
    entries = sorted(p.name for p in RESULTS.iterdir())
    assert len(entries) <= MAX_RESULTS_ENTRIES, (
        f"benchmarks/results/ has {len(entries)} entries at its top level (at most {MAX_RESULTS_ENTRIES}: "
        f"one folder per question and device; older runs live in git history): {entries}")


def test_every_results_folder_says_what_it_holds():
    folders = [p for p in RESULTS.iterdir() if p.is_dir()]
    assert folders
    for folder in folders:
        assert (folder / "README.md").exists(), f"{folder.relative_to(ROOT)} has no README.md"
