"""Module docstrings are short: every .py under services/, shared/ and infra/ with a module docstring says
what the module is and its key guarantee in at most 10 lines, and points to docs/ for the long story
("More: docs/<file>.md#<anchor>", which must name an existing file and heading). Read with ast only: no
module is imported.

    pytest -q tests/contract/test_module_docstrings.py
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

from tests.support.markdown import slugs

REPO = Path(__file__).resolve().parents[2]
ROOTS = ("services", "shared", "infra")
MAX_LINES = 10
POINTER = re.compile(r"docs/([\w.-]+\.md)(?:#([\w-]+))?")


def docstring(source: str) -> str | None:
    """The module docstring as written (not dedented), or None."""
    return ast.get_docstring(ast.parse(source), clean=False)


def line_count(source: str) -> int:
    """Lines of the module docstring, blank lines at its ends left out; 0 without one."""
    text = docstring(source)
    return 0 if text is None else len(text.strip().splitlines())


def modules() -> list[Path]:
    return sorted(p for root in ROOTS for p in (REPO / root).rglob("*.py")
                  if not {".venv", "node_modules", "__pycache__"} & set(p.parts))


def test_every_module_docstring_is_at_most_ten_lines():
    too_long = {p.relative_to(REPO).as_posix(): n for p in modules()
                if (n := line_count(p.read_text())) > MAX_LINES}
    assert too_long == {}, f"cut these to {MAX_LINES} lines and move the long story into docs/: {too_long}"


def test_docs_pointers_in_module_docstrings_resolve():
    broken = []
    for path in modules():
        for file, anchor in POINTER.findall(docstring(path.read_text()) or ""):
            target = REPO / "docs" / file
            if not target.exists():
                broken.append(f"{path.relative_to(REPO)}: no docs/{file}")
            elif anchor and anchor not in slugs(target.read_text()):
                broken.append(f"{path.relative_to(REPO)}: no heading #{anchor} in docs/{file}")
    assert broken == []


def test_the_counter_flags_an_eleven_line_docstring():
    eleven = '"""' + "\n".join(f"line {i}" for i in range(1, 12)) + '\n"""\n\nx = 1\n'
    ten = '"""' + "\n".join(f"line {i}" for i in range(1, 11)) + '\n"""\n'
    assert line_count(eleven) == 11 > MAX_LINES
    assert line_count(ten) == 10
    assert line_count('"""One line."""\n') == 1
    assert line_count("x = 1\n") == 0
    assert len(modules()) > 50  # the walk finds the code, so an empty walk cannot pass
