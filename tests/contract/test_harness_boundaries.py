"""Who imports whom around the harness: services and shared never import it (the CLI's `flywheel up` alone
starts the stack from it) nor infra/; the harness imports neither bench/ nor tests/; bench/ never imports tests/,
and tests import bench/ only to test a benchmark or the demo itself.

    pytest -q tests/contract/test_harness_boundaries.py
"""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
# Tests whose subject is a bench script (its entry point, its task or its corpus), by path prefix.
TESTS_OF_BENCH = ("tests/unit/bench/", "tests/chaos/", "tests/gpu/test_gpu_trainer_smoke.py", "tests/learning/",
                  "tests/component/test_math_grading.py",
                  "tests/component/test_trainer_engine.py",  # the demo's sampler feeds a GAE update
                  "tests/component/test_lora.py")  # LoRA parts of the demo (bench.demo's LORA settings)


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
    assert [(f, m) for f, m in imports("bench") if m in ("tests", "fixtures", "api_testlib", "trainer_testlib")] == []


def test_tests_import_bench_only_to_test_a_bench_script():
    found = [f for f, m in imports("tests") if m == "bench" and not f.startswith(TESTS_OF_BENCH)]
    assert found == [], found
