"""Secrets never reach the logs: every service runs with a password in DATABASE_URL and an API token,
serves requests (good and bad tokens), stops; no log line of any of them contains either secret, and each
logged its resolved config exactly once, the password masked."""

from __future__ import annotations

import httpx
from sqlalchemy.engine import make_url

from infra.local.stack import LocalStack

DB_PASSWORD = "pg-secret-8c1f"  # the local Postgres trusts loopback, so any password connects
API_TOKEN = "api-secret-3e9a7d"


def test_no_service_logs_a_secret(tmp_path, redis_url, database_url):
    url = make_url(database_url).set(password=DB_PASSWORD).render_as_string(hide_password=False)
    env = {"REDIS_URL": redis_url, "DATABASE_URL": url, "API_TOKEN": API_TOKEN, "LOG_LEVEL": "DEBUG"}
    with LocalStack(tmp_path, env=env) as stack:
        stack.start()
        stack.wait_healthy(90)
        with httpx.Client(base_url=stack.api_url, timeout=10) as api:
            assert api.get("/v1/runs", headers={"Authorization": f"Bearer {API_TOKEN}"}).status_code == 200
            assert api.get("/v1/runs", headers={"Authorization": f"Bearer {API_TOKEN}x"}).status_code == 401
            bad = {"name": "x", "model": "m", "dataset": "nope", "agent": {"name": "math"}, "env": {"name": "math"}}
            assert api.post("/v1/runs", json=bad, headers={"Authorization": f"Bearer {API_TOKEN}"}).status_code < 500
    logs = sorted((tmp_path / "logs").glob("*.log"))
    for log in logs:  # the services' and the stack's own (stack.log: its watchdog, embedded servers, warnings)
        text = log.read_text(errors="replace")
        assert DB_PASSWORD not in text, f"{log.name} logs the database password"
        assert API_TOKEN not in text, f"{log.name} logs the API token"
    services = [log for log in logs if log.name != "stack.log"]
    assert len(services) >= 7
    for log in services:
        text = log.read_text(errors="replace")
        assert text.strip(), f"{log.name} is empty: the check would prove nothing"
        configs = [line for line in text.splitlines() if " config: {" in line]
        assert len(configs) == 1, f"{log.name} logs its config {len(configs)} times, not once"
        assert ":***@" in configs[0], f"{log.name}: the config line does not show DATABASE_URL masked"
