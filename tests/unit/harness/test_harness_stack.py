"""Pure parts of the local stack: URL translation for Celery, the service table, restart backoff, the socket path.

    pytest -q tests/unit/harness/test_harness_stack.py
"""

from __future__ import annotations

import importlib.util
import tomllib
from pathlib import Path

from harness.servers import _redis_socket_path
from harness.stack import SERVICES, Backoff, celery_broker_url

REPO = Path(__file__).resolve().parents[3]


def test_celery_broker_url_translates_unix_sockets_only():
    assert celery_broker_url("unix:///tmp/x/redis.socket?db=3") == "redis+socket:///tmp/x/redis.socket?virtual_host=3"
    assert celery_broker_url("unix:///tmp/r.sock") == "redis+socket:///tmp/r.sock?virtual_host=0"
    assert celery_broker_url("redis://127.0.0.1:6379/2") == "redis://127.0.0.1:6379/2"


def test_service_table_matches_the_console_scripts():
    scripts = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]
    for name, spec in SERVICES.items():
        assert spec.args[0] == "-m"
        assert scripts[f"flywheel-{name}"] == f"{spec.args[1]}:main", f"{name}: stack and console script differ"
    assert scripts["flywheel-stack"] == "harness.stack:main"
    assert importlib.util.find_spec("harness.stack") is not None


def test_http_services_are_probed_on_their_own_port():
    assert SERVICES["api"].port_env == "API_PORT"
    assert SERVICES["weight-server"].port_env == "WEIGHT_SERVER_PORT"
    assert {s.port_env for n, s in SERVICES.items() if n not in ("api", "weight-server")} == {"HEALTH_PORT"}


def test_backoff_doubles_to_its_cap_and_resets_after_a_long_uptime():
    b = Backoff(base_s=1.0, cap_s=5.0, reset_after_s=60.0)
    assert [b.next_delay(uptime_s=2.0) for _ in range(5)] == [1.0, 2.0, 4.0, 5.0, 5.0]
    assert b.next_delay(uptime_s=61.0) == 1.0  # up a minute: a new crash is not part of the old loop
    assert b.next_delay(uptime_s=0.5) == 2.0


def test_redis_socket_path_is_short_and_stable_for_deep_folders(tmp_path):
    assert _redis_socket_path(tmp_path) == tmp_path / "redis.sock" or len(str(tmp_path)) >= 90
    deep = Path("/tmp") / ("d" * 120)
    path = _redis_socket_path(deep)
    assert len(str(path)) < 100 and path == _redis_socket_path(deep) != _redis_socket_path(deep / "x")
