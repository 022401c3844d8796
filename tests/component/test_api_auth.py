"""Auth on every /v1 route of a live API: 401 without a token or with a wrong one, 403 for a read-only token
on every mutating route and for a write token on admin routes; /healthz and /readyz stay open.

The routes are enumerated from the app itself (its OpenAPI paths), so a route added later is covered.

    pytest -q tests/component/test_api_auth.py
"""

from __future__ import annotations

import re
import uuid

import httpx
import pytest
from api_testlib import running_api

from services.api.app import create_app
from services.api.settings import ApiSettings


@pytest.fixture(scope="module")
def api(database_url, redis_url, tmp_path_factory):
    # no jobs service: a route that queues a job and is allowed answers 503 (not 403) once its request expires
    with running_api(database_url, redis_url, tmp_path_factory.mktemp("api-auth"), JOB_REQUEST_WAIT_S="0.5") as live:
        yield live


def v1_operations(database_url: str, redis_url: str) -> list[tuple[str, str]]:
    app = create_app(ApiSettings(database_url=database_url, redis_url=redis_url))
    ops = [(method.upper(), path) for path, item in app.openapi()["paths"].items() if path.startswith("/v1")
           for method in item if method in ("get", "post", "put", "patch", "delete")]
    app.state.engine.dispose()
    return ops


def concrete(path: str) -> str:
    return re.sub(r"\{[^}]+\}", str(uuid.uuid4()), path)


def test_enumerates_every_route(database_url, redis_url):
    ops = v1_operations(database_url, redis_url)
    assert len(ops) >= 20 and ("POST", "/v1/runs/{run_id}/stop") in ops and ("DELETE", "/v1/tokens/{token_id}") in ops


def test_401_without_or_with_a_wrong_token(api, database_url, redis_url):
    for method, path in v1_operations(database_url, redis_url):
        for headers in ({}, {"Authorization": "Bearer wrong-token"}, {"Authorization": "Basic abc"}):
            r = httpx.request(method, api.url + concrete(path), headers=headers, json={})
            assert r.status_code == 401, (method, path, headers, r.status_code)
            assert r.headers.get("www-authenticate") == "Bearer"


def test_403_for_missing_scope(api, database_url, redis_url):
    with api.client() as admin:
        read = admin.post("/v1/tokens", json={"name": "ro", "scopes": ["read"]}).json()["token"]
        write = admin.post("/v1/tokens", json={"name": "rw", "scopes": ["read", "write"]}).json()["token"]
    checked = 0
    for method, path in v1_operations(database_url, redis_url):
        admin_only = path.startswith("/v1/tokens")
        read_only_ok = method == "GET" or path == "/v1/sql"
        for token, allowed in ((read, read_only_ok and not admin_only), (write, not admin_only)):
            r = httpx.request(method, api.url + concrete(path), headers={"Authorization": f"Bearer {token}"}, json={})
            if allowed:
                assert r.status_code != 403, (method, path, r.text)
            else:
                assert r.status_code == 403, (method, path, r.status_code)
                assert "scope" in r.json()["message"]
                checked += 1
    assert checked >= 10


def test_open_routes(api):
    for path in ("/healthz", "/readyz", "/metrics", "/openapi.json", "/ui/"):
        assert httpx.get(api.url + path).status_code == 200, path
