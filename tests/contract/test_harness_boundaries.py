"""Who imports whom around the local stack and the test support: services and shared never import infra/ (the
CLI's `flywheel up` alone starts the local stack from infra.local); bench/ imports of tests/ only tests.support
(tests/contract/test_layering.py checks the rest).

    pytest -q tests/contract/test_harness_boundaries.py
"""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]



def imports(folder: str, full: bool = False) -> list[tuple[str, str]]:
    """(file relative to the repo, top-level package, or with `full` the module) for every absolute import under
    `folder`."""
    out = []
    for path in sorted((REPO / folder).rglob("*.py")):
        rel = str(path.relative_to(REPO))
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                out += [(rel, a.name if full else a.name.split(".")[0]) for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                out.append((rel, node.module if full else node.module.split(".")[0]))
    return out


def test_services_and_shared_import_infra_only_to_start_the_local_stack():
    found = [(f, m) for d in ("services", "shared") for f, m in imports(d) if m in ("infra", "bench")]
    assert found == [("services/api/cli.py", "infra")], found


def test_bench_imports_of_tests_are_test_support():
    assert [(f, m) for f, m in imports("bench", full=True)
            if m.split(".")[0] in ("tests", "fixtures", "api_testlib") and not m.startswith("tests.support")] == []
