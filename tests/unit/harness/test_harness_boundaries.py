"""Who imports whom around the local stack and the test support: services and shared never import infra/ (the
CLI's `flywheel up` alone starts the local stack from infra.local); bench/ imports of tests/ only tests.support,
and tests import bench/ only to test a benchmark or the demo itself (tests/unit/test_layering.py checks the rest).

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


def test_tests_import_bench_only_to_test_a_bench_script():
    found = [f for f, m in imports("tests") if m == "bench" and not f.startswith(TESTS_OF_BENCH)]
    assert found == [], found
