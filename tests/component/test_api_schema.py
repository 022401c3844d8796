"""The API's contract: `schemathesis run --checks all` against the live API passes (every status documented,
responses match their schemas, one error shape, Allow headers, auth declared and enforced; the exceptions the
schema cannot express are in schemathesis.toml with their reasons), every route declares a response model, and
every call the CLI makes exists in the schema.

    pytest -q tests/component/test_api_schema.py
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from api_testlib import REPO, running_api

from services.api.app import create_app
from services.api.settings import ApiSettings

SCHEMATHESIS = Path(sys.executable).with_name("schemathesis")


@pytest.fixture(scope="module")
def live_api(database_url, redis_url, tmp_path_factory):
    with running_api(database_url, redis_url, tmp_path_factory.mktemp("api-fuzz"), jobs=True) as live:
        yield live


# The pytest plugin of schemathesis does not run under pytest 9, so the test runs its CLI, which is also the
# command a user would run (with the repo's schemathesis.toml).
def test_schemathesis_checks_all_pass(live_api, tmp_path):
    cmd = [str(SCHEMATHESIS), "run", "--checks", "all", "--max-examples", "8", "--workers", "1",
           "--seed", "1", "--no-color",
           "-H", f"Authorization: Bearer {live_api.token}", f"{live_api.url}/openapi.json"]
    out = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=540)
    assert out.returncode == 0, out.stdout[-6000:] + out.stderr[-2000:]
    assert re.search(r"Selected: (\d+)/\1", out.stdout) and int(re.search(r"Selected: (\d+)", out.stdout)[1]) >= 28


def test_every_route_declares_a_response_model():
    app = create_app(ApiSettings(database_url="postgresql+psycopg://x@127.0.0.1:1/x", redis_url="redis://127.0.0.1:1"))
    spec = app.openapi()
    assert len([op for ops in spec["paths"].values() for op in ops]) >= 30
    for path, ops in spec["paths"].items():
        for method, op in ops.items():
            ok = [code for code in op["responses"] if code.startswith("2")]
            assert ok, (method, path)
            for code in ok:  # `-> dict` without response_model=... gives an anonymous {"type": "object"}
                schemas = [c.get("schema") or {} for c in op["responses"][code].get("content", {}).values()]
                assert code == "204" or path == "/metrics" or any("$ref" in s for s in schemas), \
                    f"{method.upper()} {path} declares no response model"
            errors = [code for code in op["responses"] if code[0] in "45"]
            for code in errors:
                assert op["responses"][code]["content"]["application/json"]["schema"]["$ref"].endswith(
                    "ErrorBody") or path == "/readyz", (method, path, code)
    assert spec["paths"]["/metrics"]["get"]["responses"]["200"]["content"].keys() == {"text/plain"}
    assert spec["components"]["securitySchemes"]["HTTPBearer"]["scheme"] == "bearer"


def test_cli_calls_exist_in_the_schema():
    """Each `call("METHOD", "/v1/...")` in the CLI names an operation of the API (path parameters as {x})."""
    spec = create_app(ApiSettings(database_url="postgresql+psycopg://x@127.0.0.1:1/x",
                                redis_url="redis://127.0.0.1:1")).openapi()
    operations = {(m.upper(), re.sub(r"\{[^}]+\}", "{}", p)) for p, ops in spec["paths"].items() for m in ops}
    source = (REPO / "services/api/cli.py").read_text()
    calls = re.findall(r'call\("(\w+)", f?"(/v1/[^"]*)"', source)
    assert len(calls) >= 12
    calls = [(m, p.replace("{action}", a)) for m, p in calls for a in ("pause", "resume", "stop")]  # _control
    used = {(m, re.sub(r"\{[^}]+\}", "{}", p)) for m, p in calls}
    assert used - operations == set()


def test_errors_have_one_shape_and_allow_is_complete(live_api):
    with live_api.client() as c:
        for r in (c.get("/v1/runs/00000000-0000-0000-0000-000000000000"), c.get("/v1/runs", params={"limit": 0}),
                  c.post("/v1/runs", json={"name": "x"}), c.put("/v1/datasets"),
                  httpx.get(live_api.url + "/v1/runs"), c.get("/v1/nowhere")):
            body = r.json()
            assert r.status_code >= 400 and set(body) == {"message", "detail"}, (r.status_code, body)
            assert all(set(d) == {"field", "message", "hint"} for d in body["detail"]), body
        allow = c.request("OPTIONS", "/v1/datasets")
        assert allow.status_code == 405 and set(allow.headers["allow"].split(", ")) == {"GET", "POST"}
        limit = c.get("/v1/runs", params={"limit": 0}).json()["detail"][0]
        assert limit["field"] == "query.limit"
