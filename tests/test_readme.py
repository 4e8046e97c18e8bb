"""The README's quick start and CI stay in step."""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def quick_start_commands():
    text = (ROOT / "README.md").read_text()
    section = text.split("## Quick start", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```bash\n(.+?)\n```", section, flags=re.S)


def test_readme_has_two_quick_start_commands():
    commands = quick_start_commands()
    assert len(commands) == 2
    assert commands[0].strip().endswith("zipfusion demo")
    assert "pytest" in commands[1]


def test_ci_runs_the_readme_test_command():
    test_command = quick_start_commands()[1].strip()
    ci = (ROOT / ".ci" / "run").read_text()
    assert test_command in ci


def test_the_test_commands_plugins_are_in_the_test_extra():
    """The README's test command lists the slowest tests and times each out; the plugins its
    flags need are installed by its ``.[test]``."""
    command = quick_start_commands()[1]
    extra = re.search(r"^test = \[(.*)\]$", (ROOT / "pyproject.toml").read_text(), re.M).group(1)
    assert "--durations=25" in command and "--timeout=" in command
    for flag, plugin in (("-n auto", "pytest-xdist"), ("--timeout=", "pytest-timeout")):
        assert flag not in command or f'"{plugin}"' in extra, f"the test command's {flag} needs {plugin} in .[test]"


def test_the_python_snippet_runs_as_written(capsys):
    """Issue 48: the README's Python snippet runs wherever the quick start runs (a CPU, a few GiB
    free): no GPU-sized kv_memory_gb, no model path to fill in."""
    section = (ROOT / "README.md").read_text().split("## Use", 1)[1].split("\n## ", 1)[0]
    snippet = re.findall(r"```python\n(.+?)\n```", section, flags=re.S)
    assert len(snippet) == 1
    exec(compile(snippet[0], "README.md", "exec"), {})
    assert capsys.readouterr().out.strip()


def test_readme_is_short():
    lines = (ROOT / "README.md").read_text().count("\n")
    assert lines <= 150, f"README.md has {lines} lines: what it is, quick start, use, one results table, links"


@pytest.mark.parametrize("doc", ["README.md", *sorted(str(p.relative_to(ROOT)) for p in (ROOT / "docs").glob("*.md"))])
def test_docs_carry_no_work_history(doc):
    text = (ROOT / doc).read_text()
    found = re.findall(r".{0,40}\b(?:session|stop \d+|issue #?\d+)\b.{0,40}", text, flags=re.I)
    assert not found, f"{doc} narrates the work's history (git keeps it): {found[:5]}"
