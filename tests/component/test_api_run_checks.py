"""POST /v1/runs refuses a run that cannot work (shared/clients/run_commands.py, the checks the eval job makes too), with the
field, the reason and how to fix it, before anything is stored: a model folder that does not exist, a relative
path that is no folder and no hub id, token budgets past the model's context, an engine no live rollout worker
offers, dataset rows without the env's fields.

    pytest -q tests/component/test_api_run_checks.py
"""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import redis
from api_testlib import run_config, running_api, start_api

from shared.clients.run_commands import _hub_problem

ROWS = [{"id": f"q{i}", "question": f"{i}+{i}?", "answer": str(2 * i)} for i in range(3)]


class StubHub(BaseHTTPRequestHandler):
    """The hub's model route as huggingface.co answers it: 200 for a model it has, 401 for one it has not (to
    an anonymous user); `org/slow` answers after 3 s."""

    def do_GET(self):  # noqa: N802 (http.server's name)
        if self.path == "/api/models/org/slow":
            time.sleep(3)
        found = self.path in ("/api/models/org/there", "/api/models/org/slow")
        body = b'{"id": "org/there"}' if found else b'{"error": "Repository not found"}'
        self.send_response(200 if found else 401)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def hub():
    server = ThreadingHTTPServer(("127.0.0.1", 0), StubHub)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


@pytest.fixture(scope="module")
def api(database_url, redis_url, tmp_path_factory, hub):
    with running_api(database_url, redis_url, tmp_path_factory.mktemp("run-checks"), jobs=True, hf_endpoint=hub,
                     hub_timeout_s="1") as live:
        with live.client() as c:
            for name, rows in (("checks", ROWS), ("no-answers", [{"id": "a", "question": "1+1?"}, *ROWS])):
                body = "\n".join(json.dumps(r) for r in rows).encode()
                assert c.post("/v1/datasets", data={"name": name}, files={"file": (f"{name}.jsonl", body)}).status_code == 201
        yield live


@pytest.fixture
def client(api):
    with api.client() as c:
        yield c


@pytest.fixture
def model_dir(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen2", "max_position_embeddings": 256}))
    return tmp_path


def refused(r, status: int, field: str) -> dict:
    assert r.status_code == status, r.text
    items = {d["field"]: d for d in r.json()["detail"]}
    assert field in items, r.json()
    return items[field]


@pytest.mark.parametrize("model, words", [
    ("/no/such/model/folder", "does not exist"),
    ("./no-such-model", "does not exist"),
    ("../no-such-model", "does not exist"),
    ("tests/no-such-model", "looks like a local path"),  # ./tests exists: a mistyped path, not a hub id
    (".data/models/no-such-model", "neither a folder that exists nor a hub id"),
    ("not a hub id!", "neither a folder that exists nor a hub id"),
])
def test_model_that_cannot_load_is_refused(client, model, words):
    item = refused(client.post("/v1/runs", json=run_config("checks", model=model)), 400, "model")
    assert words in item["message"]
    assert "repo root" in item["hint"]


def test_missing_model_hint_says_how_to_make_the_tiny_model(client):
    item = refused(client.post("/v1/runs", json=run_config("checks", model=".data/models/tiny-qwen2-x")), 400, "model")
    assert "python -m tests.support.tiny_model" in item["hint"]


def test_a_file_is_not_a_model(client, model_dir):
    item = refused(client.post("/v1/runs", json=run_config("checks", model=str(model_dir / "config.json"))),
                   400, "model")
    assert "is a file" in item["message"]


def test_token_budgets_past_the_context_are_refused(client, model_dir):
    cfg = run_config("checks", model=str(model_dir), max_prompt_tokens=200, max_response_tokens=100)
    item = refused(client.post("/v1/runs", json=cfg), 400, "max_response_tokens")
    assert "200 + 100 = 300 exceeds the model's context of 256" in item["message"] and "256" in item["hint"]
    cfg = run_config("checks", model=str(model_dir), max_prompt_tokens=200, max_response_tokens=56,
                     max_context_tokens=300)
    item = refused(client.post("/v1/runs", json=cfg), 400, "max_context_tokens")
    assert "300 exceeds the model's context of 256" in item["message"] and "256" in item["hint"]
    ok = client.post("/v1/runs", json=run_config("checks", model=str(model_dir), max_prompt_tokens=200,
                                                 max_response_tokens=56))
    assert ok.status_code == 201, ok.text


def test_engine_no_live_worker_offers_is_refused(client, redis_url, model_dir):
    r = redis.Redis.from_url(redis_url)
    r.set("heartbeat:rollout-worker:fake-1", json.dumps({"service": "rollout-worker", "engines": ["hf", "openai"]}),
          ex=60)
    try:
        cfg = run_config("checks", model=str(model_dir), max_prompt_tokens=64, max_response_tokens=64,
                         engine={"type": "vllm"})
        item = refused(client.post("/v1/runs", json=cfg), 400, "engine.type")
        assert "no live rollout worker offers engine 'vllm'" in item["message"] and "hf, openai" in item["hint"]
        cfg["engine"] = {"type": "hf"}
        assert client.post("/v1/runs", json=cfg).status_code == 201
    finally:
        r.delete("heartbeat:rollout-worker:fake-1")
    cfg["engine"] = {"type": "vllm"}  # no worker up: not checked (workers may start after the run is created)
    assert client.post("/v1/runs", json=cfg).status_code == 201


def test_rows_without_the_envs_fields_are_refused(client):
    item = refused(client.post("/v1/runs", json=run_config("no-answers")), 400, "dataset")
    assert "'ground_truth' or 'answer' or 'solution'" in item["message"] and "'a'" in item["message"]
    given = run_config("no-answers", env={"name": "math", "args": {"ground_truth": "2"}})
    assert client.post("/v1/runs", json=given).status_code == 201  # env.args gives it for every row


def test_nothing_is_stored_for_a_refused_run(client):
    before = client.get("/v1/runs").json()["count"]
    assert client.post("/v1/runs", json=run_config("checks", model="/no/such/model")).status_code == 400
    assert client.get("/v1/runs").json()["count"] == before


def test_several_problems_are_listed_together(client, redis_url):
    r = redis.Redis.from_url(redis_url)
    r.set("heartbeat:rollout-worker:fake-2", json.dumps({"engines": ["hf"]}), ex=60)
    try:
        resp = client.post("/v1/runs", json=run_config("no-answers", model="/no/such/model", engine={"type": "vllm"}))
    finally:
        r.delete("heartbeat:rollout-worker:fake-2")
    assert resp.status_code == 400
    assert {d["field"] for d in resp.json()["detail"]} == {"model", "engine.type", "dataset"}


def test_lora_target_modules_the_model_lacks_are_refused(client, tmp_path):
    from tests.support.tiny_model import build_number_model

    model = str(build_number_model(tmp_path / "number"))
    lora = {"rank": 4, "target_modules": ["q_proj", "qkv_proj"]}
    cfg = run_config("checks", model=model, max_prompt_tokens=64, max_response_tokens=8, algorithm={"lora": lora})
    item = refused(client.post("/v1/runs", json=cfg), 400, "algorithm.lora.target_modules")
    assert "no module named 'qkv_proj'" in item["message"] and "q_proj" not in item["message"]
    assert "v_proj" in item["hint"] and "all-linear" in item["hint"]
    for targets in (["q_proj", "v_proj"], ["self_attn.o_proj"], "all-linear"):
        cfg["algorithm"]["lora"]["target_modules"] = targets
        assert client.post("/v1/runs", json=cfg).status_code == 201, targets
    cfg["algorithm"]["lora"]["rank"] = 1000  # sane rank: the field and the bound, before anything is stored
    r = client.post("/v1/runs", json=cfg)
    assert r.status_code == 422 and "rank" in r.text and "256" in r.text, r.text


def test_a_hub_id_the_hub_does_not_have_is_refused_at_once(client):
    started = time.monotonic()
    item = refused(client.post("/v1/runs", json=run_config("checks", model="nope/nomodel")), 400, "model")
    assert "the hub has no model 'nope/nomodel' (HTTP 401" in item["message"] and "HF_TOKEN" in item["hint"]
    assert time.monotonic() - started < 5
    assert client.post("/v1/runs", json=run_config("checks", model="org/there")).status_code == 201


def test_a_hub_id_is_refused_when_no_hub_answers_in_time(client, database_url, redis_url, tmp_path):
    started = time.monotonic()
    item = refused(client.post("/v1/runs", json=run_config("checks", model="org/slow")), 400, "model")
    assert "no hub answered at http://127.0.0.1:" in item["message"] and "within 1s" in item["message"]
    assert "local model folder" in item["hint"]
    assert time.monotonic() - started < 2.9  # the API's HUB_TIMEOUT_S, not the hub's 3 s
    nothing = start_api(database_url, redis_url, tmp_path, controller=False, hf_endpoint="http://127.0.0.1:1")
    try:  # nothing listens at the hub's address (a machine without network): refused, with the address
        with nothing.client() as c:
            item = refused(c.post("/v1/runs", json=run_config("checks", model="nope/nomodel")), 400, "model")
        assert "no hub answered at http://127.0.0.1:1 within" in item["message"]
    finally:
        nothing.stop()


def test_a_hub_id_is_refused_without_asking_when_the_hub_is_offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:1")  # were it asked, the message would say so
    problem = _hub_problem("model", "nope/nomodel", "")
    assert problem is not None and "the hub is offline (HF_HUB_OFFLINE)" in problem.message
