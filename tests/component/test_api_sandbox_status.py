"""A run's sandbox mode through the live API: explicit in the stored config for envs that run model code, and a
warning in the run's status when it is `none`; an unknown mode is a 422 naming the field."""

from __future__ import annotations

import json

import pytest
from api_testlib import run_config, start_api


@pytest.fixture(scope="module")
def client(database_url, redis_url, tmp_path_factory):
    live = start_api(database_url, redis_url, tmp_path_factory.mktemp("api"), jobs=True)
    with live.client() as c:
        rows = [{"id": f"c{i}", "question": "write f", "tests": "assert f() == 1"} for i in range(2)]
        r = c.post("/v1/datasets", data={"name": "code-tasks", "split": "train"},
                   files={"file": ("code.jsonl", "\n".join(json.dumps(r) for r in rows).encode())})
        assert r.status_code == 201, r.text
        yield c
    live.stop()


def test_sandbox_mode_and_warning_in_run_status(client):
    cfg = run_config("code-tasks", kind="eval", agent={"name": "code"}, env={"name": "code"})
    default = client.post("/v1/runs", json=cfg | {"name": "ns"})
    assert default.status_code == 201, default.text
    assert default.json()["sandbox"] == "namespaces" and default.json()["warnings"] == []
    assert default.json()["config"]["env"]["args"]["sandbox"] == "namespaces"  # stored explicitly

    weak = client.post("/v1/runs", json=cfg | {"name": "weak", "env": {"name": "code", "args": {"sandbox": "none"}}})
    assert weak.status_code == 201, weak.text
    shown = client.get(f"/v1/runs/{weak.json()['id']}").json()
    assert shown["sandbox"] == "none" and "without a kernel boundary" in shown["warnings"][0]

    bad = client.post("/v1/runs", json=cfg | {"env": {"name": "code", "args": {"sandbox": "off"}}})
    assert bad.status_code == 422 and "unknown sandbox mode 'off'" in bad.text
