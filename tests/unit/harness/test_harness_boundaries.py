"""Who imports whom around the harness: services and shared never import it (the CLI's `flywheel up` alone
starts the stack from it) nor infra/; the harness imports neither bench/ nor tests/; bench/ never imports tests/,
and tests import bench/ only to test a benchmark or the demo itself.

    pytest -q tests/unit/harness/test_harness_boundaries.py
"""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]
# Tests whose subject is a bench script (its entry point, its task or its corpus), by path prefix.
TESTS_OF_BENCH = ("tests/unit/bench/", "tests/chaos/", "tests/gpu/test_gpu_trainer_smoke.py",
                  "tests/integration/test_learning_", "tests/unit/builtin/test_math_grading.py",
                  "tests/integration/test_trainer_engine.py",  # the demo's sampler feeds a GAE update
                  "tests/integration/test_lora.py")  # runs `make demo-lora` (bench.demo's run_stack with LoRA)


def imports(folder: str) -> list[tuple[str, str]]:
    """(file relative to the repo, top-level package) for every absolute import under `folder`."""
    out = []
    for path in sorted((REPO / folder).rglob("*.py")):
        rel = str(path.relative_to(REPO))
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                out += [(rel, a.name.split(".")[0]) for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                out.append((rel, node.module.split(".")[0]))
    return out


def test_services_and_shared_import_neither_harness_nor_infra():
    found = [(f, m) for d in ("services", "shared") for f, m in imports(d) if m in ("harness", "infra", "bench")]
    assert found == [("services/api/cli.py", "harness")], found


def test_harness_imports_neither_bench_nor_tests():
    assert [(f, m) for f, m in imports("harness") if m in ("bench", "tests", "fixtures")] == []


def test_bench_does_not_import_tests():
    assert [(f, m) for f, m in imports("bench") if m in ("tests", "fixtures", "api_testlib")] == []


def test_tests_import_bench_only_to_test_a_bench_script():
    found = [f for f, m in imports("tests") if m == "bench" and not f.startswith(TESTS_OF_BENCH)]
    assert found == [], found
