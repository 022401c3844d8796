"""Pure parts of the local stack: URL translation for Celery and the service table.

    pytest -q tests/unit/infra/test_infra_local_stack.py
"""

from __future__ import annotations

import importlib.util
import tomllib
from pathlib import Path

from infra.local_stack import SERVICES, celery_broker_url

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
    assert scripts["flywheel-stack"] == "infra.local_stack:main"
    assert importlib.util.find_spec("infra.local_stack") is not None


def test_http_services_are_probed_on_their_own_port():
    assert SERVICES["api"].port_env == "API_PORT"
    assert SERVICES["weight-server"].port_env == "WEIGHT_SERVER_PORT"
    assert {s.port_env for n, s in SERVICES.items() if n not in ("api", "weight-server")} == {"HEALTH_PORT"}
