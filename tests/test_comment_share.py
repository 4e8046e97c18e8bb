"""src/ reads as code, not as a lab diary: comments and docstrings stay short and carry no history
(issue or stop numbers, dates, GPU model names; measurements go to docs/benchmarks.md)."""

import io
import re
import tokenize
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src" / "zipfusion"
MAX_SHARE = 0.12
HISTORY = re.compile(r"\bissue #?\d+|\bstop \d+|\b20\d\d-\d\d-\d\d\b|\b[ABH]100\b|\b[BH]200\b", re.I)


def comment_lines(text: str) -> dict[int, str]:
    """Line number -> text of every line holding a comment or a statement-level string (a docstring)."""
    out, prev = {}, None
    for tok in tokenize.generate_tokens(io.StringIO(text).readline):
        if tok.type == tokenize.COMMENT:
            out[tok.start[0]] = tok.string
        elif tok.type == tokenize.STRING and (prev is None or prev.type in (
                tokenize.INDENT, tokenize.DEDENT, tokenize.NEWLINE, tokenize.NL)):
            for i, line in enumerate(tok.string.splitlines(), tok.start[0]):
                out[i] = line
        if tok.type not in (tokenize.NL, tokenize.COMMENT):
            prev = tok
    return out


def test_comment_lines_finds_comments_and_docstrings_only():
    text = '"""Module.\n\nMore."""\nx = "not a docstring"  # a comment\n\n\ndef f():\n    """Doc."""\n    return "s"\n'
    assert sorted(comment_lines(text)) == [1, 2, 3, 4, 8]


def test_comments_and_docstrings_are_a_small_share_of_src():
    comments = code = 0
    for path in SRC.rglob("*.py"):
        text = path.read_text()
        comments += len(comment_lines(text))
        code += sum(1 for line in text.splitlines() if line.strip())
    assert comments / code <= MAX_SHARE, f"{comments} of {code} non-blank src lines are comments or docstrings"


def test_no_history_in_src_comments():
    found = [f"{path.relative_to(SRC)}:{n}: {line.strip()}" for path in sorted(SRC.rglob("*.py"))
             for n, line in comment_lines(path.read_text()).items() if HISTORY.search(line)]
    assert not found, "history belongs in docs/benchmarks.md or a commit message:\n" + "\n".join(found[:20])
