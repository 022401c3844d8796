"""Every REST route against a live API process on the real Postgres/Redis: happy paths and bad input.

    pytest -q tests/component/test_api_routes.py
"""

from __future__ import annotations

import io
import json
import uuid

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import redis
from api_testlib import run_config, seed_run, start_api, trainer_metrics
from sqlalchemy import create_engine, text

from shared.contracts.messages import RunControl, decode
from shared.contracts.streams import RUN_CONTROL


@pytest.fixture(scope="module")
def api(database_url, redis_url, tmp_path_factory):
    live = start_api(database_url, redis_url, tmp_path_factory.mktemp("api"), jobs=True,
                     JAEGER_UI_URL="http://jaeger.test:16686/")
    yield live
    live.stop()
    assert live.proc.returncode in (0, -15)  # uvicorn re-raises SIGTERM after a clean shutdown


@pytest.fixture(scope="module")
def client(api):
    with api.client() as c:
        yield c


def upload(client, name: str, rows: list[dict], split: str = "train", fmt: str = "jsonl"):
    if fmt == "jsonl":
        data = "\n".join(json.dumps(r) for r in rows).encode()
    else:
        buf = io.BytesIO()
        pq.write_table(pa.Table.from_pylist(rows), buf)
        data = buf.getvalue()
    return client.post("/v1/datasets", data={"name": name, "split": split},
                       files={"file": (f"{name}.{fmt}", data)})


ROWS = [{"id": f"q{i}", "question": f"{i}+{i}?", "answer": str(2 * i)} for i in range(5)]


@pytest.fixture(scope="module")
def dataset(client):
    r = upload(client, "arith", ROWS)
    assert r.status_code == 201, r.text
    return "arith"


def test_health_ready_metrics_are_open(api):
    import httpx

    assert httpx.get(api.url + "/healthz").json()["status"] == "ok"
    ready = httpx.get(api.url + "/readyz")
    assert ready.status_code == 200 and ready.json() == {"ready": True, "redis": True, "postgres": True}
    metrics = httpx.get(api.url + "/metrics").text
    assert "api_requests_total" in metrics and 'stream_length{stream="rollout.tasks"}' in metrics


def test_heartbeat_key(api, redis_url):
    import redis

    r = redis.Redis.from_url(redis_url)
    assert any(k.startswith(b"heartbeat:api:") for k in r.scan_iter("heartbeat:api:*"))


def test_run_view_names_a_controller_or_trainer_whose_heartbeat_says_postgres_is_unreachable(client, dataset,
                                                                                             redis_url):
    """The API reaches Postgres, a controller does not: the live run's view says so (from the controller's
    heartbeat), and says nothing once the heartbeat no longer does."""
    from shared.contracts.streams import heartbeat_key

    r = redis.Redis.from_url(redis_url)
    run = client.post("/v1/runs", json=run_config(dataset, name="cut-off")).json()
    assert client.get(f"/v1/runs/{run['id']}").json().get("outage") is None
    key = heartbeat_key("controller", "ctl-cut")
    r.set(key, json.dumps({"service": "controller", "worker_id": "ctl-cut", "unreachable": ["postgres"]}), px=60_000)
    try:
        outage = client.get(f"/v1/runs/{run['id']}").json().get("outage")
        assert outage and "controller ctl-cut cannot reach PostgreSQL" in outage and "nothing is dispatched" in outage
    finally:
        r.delete(key)
    assert client.get(f"/v1/runs/{run['id']}").json().get("outage") is None


def test_openapi_and_docs(api, client):
    import httpx

    spec = httpx.get(api.url + "/openapi.json").json()
    assert "/v1/runs" in spec["paths"] and "/v1/runs/{run_id}/trajectories" in spec["paths"]
    assert httpx.get(api.url + "/docs").status_code == 200


def test_datasets_upload_list_preview_delete(client, dataset):
    assert upload(client, "arith-pq", ROWS, split="test", fmt="parquet").status_code == 201
    names = {(d["name"], d["split"], d["num_rows"]) for d in client.get("/v1/datasets").json()["data"]}
    assert {("arith", "train", 5), ("arith-pq", "test", 5)} <= names
    rows = client.get("/v1/datasets/arith/rows", params={"offset": 1, "limit": 2}).json()["data"]
    assert [(r["idx"], r["task_id"], r["data"]["answer"]) for r in rows] == [(1, "q1", "2"), (2, "q2", "4")]
    assert client.get("/v1/datasets/arith").json()["splits"]["train"]["num_rows"] == 5
    assert client.delete("/v1/datasets/arith-pq", params={"split": "test"}).status_code == 204
    assert client.get("/v1/datasets/arith-pq").status_code == 404
    assert client.delete("/v1/datasets/arith-pq").status_code == 404


def test_dataset_upload_bad_input_names_the_problem(client):
    r = client.post("/v1/datasets", data={"name": "bad"}, files={"file": ("bad.jsonl", b'{"a": 1}\n{nope\n')})
    assert r.status_code == 400 and "line 2" in r.json()["message"] and r.json()["detail"][0]["field"] == "file"
    r = upload(client, "dupes", [{"id": "x"}, {"id": "x"}])
    assert r.status_code == 400 and "duplicate task id 'x'" in r.json()["message"]
    r = client.post("/v1/datasets", data={"name": "bad"}, files={"file": ("bad.txt", b"hello")})
    assert r.status_code == 400 and "unknown format" in r.json()["message"]
    r = client.post("/v1/datasets", data={"name": "../etc"}, files={"file": ("x.jsonl", b'{"a": 1}')})
    assert r.status_code == 422 and r.json()["detail"][0]["field"] == "name"
    assert client.get("/v1/datasets/nope/rows").status_code == 404


def test_create_list_show_run(client, dataset):
    r = client.post("/v1/runs", json=run_config(dataset, name="r1"))
    assert r.status_code == 201, r.text
    run = r.json()
    assert run["status"] == "pending" and run["config"]["dataset"] == dataset and run["kind"] == "train"
    shown = client.get(f"/v1/runs/{run['id']}").json()
    assert shown["progress"]["done"] == 0 and shown["ledger"]["units"]["in_flight"] == 0
    assert shown["progress"] == {"unit": "samples", "done": 0, "total": 5 * 2, "fraction": 0.0}
    listed = client.get("/v1/runs", params={"status": "pending", "limit": 100}).json()
    assert run["id"] in [x["id"] for x in listed["data"]] and listed["count"] >= 1
    assert client.get("/v1/runs", params={"status": "completed"}).json()["data"] == [] or all(
        x["status"] == "completed" for x in client.get("/v1/runs", params={"status": "completed"}).json()["data"])
    events = client.get(f"/v1/runs/{run['id']}/events").json()["data"]
    assert events[0]["kind"] == "created"


@pytest.mark.parametrize("patch, field", [
    ({"env": {"name": "no_such_pkg.envs:Env"}}, "env"),
    ({"env": {"name": "not a path"}}, "env"),
    ({"samples_per_task": 0}, "samples_per_task"),
    ({"algorithm": {"adv_estimator": "magic"}}, "adv_estimator"),
    ({"unknown_field": 1}, "unknown_field"),
    ({"samples_per_task": 1}, "samples_per_task"),  # grpo needs groups
])
def test_bad_run_config_names_the_field(client, dataset, patch, field):
    r = client.post("/v1/runs", json=run_config(dataset) | patch)
    assert r.status_code == 422, r.text
    assert field in json.dumps(r.json()["detail"]) and set(r.json()) == {"message", "detail"}


def test_run_on_a_missing_dataset_is_404(client):
    r = client.post("/v1/runs", json=run_config("no-such-dataset"))
    assert r.status_code == 404 and r.json()["detail"][0]["field"] == "dataset"
    assert "flywheel datasets import" in r.json()["detail"][0]["hint"]


def test_run_body_not_json_is_4xx(client):
    r = client.post("/v1/runs", content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 422


def test_state_transitions_and_conflicts(client, dataset, database_url, redis_url):
    run_id = client.post("/v1/runs", json=run_config(dataset, name="lifecycle")).json()["id"]
    r = client.post(f"/v1/runs/{run_id}/pause")
    assert r.status_code == 409 and "pending" in r.json()["message"]
    running = seed_run(database_url, name="live", status="running", dataset=dataset)
    assert client.post(f"/v1/runs/{running}/pause").json()["status"] == "paused"
    assert client.post(f"/v1/runs/{running}/pause").status_code == 409
    assert client.post(f"/v1/runs/{running}/resume").json()["status"] == "running"
    assert client.post(f"/v1/runs/{running}/stop").json()["status"] == "stopping"
    r = client.post(f"/v1/runs/{running}/resume")
    assert r.status_code == 409 and "stopping" in r.json()["message"]
    assert client.post(f"/v1/runs/{uuid.uuid4()}/stop").status_code == 404
    r = client.post("/v1/runs/not-a-uuid/stop")  # neither an id nor a name: no run
    assert r.status_code == 404 and r.json()["detail"][0]["field"] == "run_id", r.text
    assert client.post("/v1/runs/lifecycle/stop").json()["status"] == "stopping"  # a run's name addresses it
    kinds = [e["kind"] for e in client.get(f"/v1/runs/{running}/events").json()["data"]]
    assert kinds.count("status_changed") >= 4
    # each accepted change is a command on run.control for the controller and the trainer; refused ones are not
    with redis.Redis.from_url(redis_url) as r:
        commands = [decode(fields, RunControl) for _, fields in r.xrange(RUN_CONTROL)]
    assert [c.action for c in commands if c.run_id == str(running)] == ["pause", "resume", "stop"]
    assert [c.action for c in commands if c.run_id == run_id] == ["stop"]


def test_trajectories_filters_and_detail(client, database_url):
    run_id = seed_run(database_url, name="traj", num_tasks=3, samples=2, versions=3)
    base = f"/v1/runs/{run_id}/trajectories"
    page = client.get(base, params={"limit": 5}).json()
    assert page["count"] == 3 * 2 * 3 and len(page["data"]) == 5
    assert client.get(base, params={"limit": 5, "offset": 15}).json()["data"].__len__() == 3
    v1 = client.get(base, params={"policy_version": 1, "limit": 100}).json()["data"]
    assert len(v1) == 6 and all(t["policy_version_max"] == 1 for t in v1)
    good = client.get(base, params={"min_reward": 0.5, "limit": 100}).json()["data"]
    assert good and all(t["reward"] >= 0.5 for t in good)
    bad = client.get(base, params={"max_reward": 0.5, "limit": 100}).json()["data"]
    assert len(good) + len(bad) == 18
    trunc = client.get(base, params={"termination_reason": "response_truncation", "limit": 100}).json()["data"]
    assert trunc and {t["termination_reason"] for t in trunc} == {"response_truncation"}
    t1 = client.get(base, params={"task_id": "task-1", "limit": 100}).json()["data"]
    assert len(t1) == 6 and {t["task_id"] for t in t1} == {"task-1"}
    assert client.get(base, params={"termination_reason": "bogus"}).status_code == 422
    assert client.get(base, params={"limit": 0}).status_code == 422

    detail = client.get(f"/v1/trajectories/{t1[0]['id']}", params={"include_tokens": True}).json()
    assert [s["step_idx"] for s in detail["steps"]] == [0, 1]
    assert detail["steps"][0]["chat_completions"][0]["role"] == "user"
    assert detail["tokens"][0]["response_ids"] == [4, 5, 6] and detail["episode"]["task"]["answer"] == "2"
    # the unit's timeline: dispatched (ledger), started, finished, stored; no trace id, no trace link
    timeline = detail["timeline"]
    assert timeline["dispatched_at"] and timeline["stored_at"] and timeline["trace_id"] is None
    assert timeline["trace_url"] is None
    engine = create_engine(database_url)
    with engine.begin() as conn:  # what a rollout worker with tracing on stores
        conn.execute(text("UPDATE episodes SET info = info || '{\"trace_id\": \"4bf92f3577b34da6a3ce929d0e0e4736\"}', "
                          "started_at = now() - interval '2 s', finished_at = now() - interval '1 s' "
                          "WHERE id = :id"), {"id": detail["episode"]["id"]})
    engine.dispose()
    timeline = client.get(f"/v1/trajectories/{t1[0]['id']}").json()["timeline"]
    assert timeline["trace_id"] == "4bf92f3577b34da6a3ce929d0e0e4736"
    assert timeline["trace_url"] == "http://jaeger.test:16686/trace/4bf92f3577b34da6a3ce929d0e0e4736"
    assert timeline["started_at"] < timeline["finished_at"]
    assert client.get(f"/v1/trajectories/{uuid.uuid4()}").status_code == 404


def test_run_detail_metrics_checkpoints_rewards(client, database_url):
    run_id = seed_run(database_url, name="metrics", kind="eval", num_tasks=2, samples=2, versions=3)
    detail = client.get(f"/v1/runs/{run_id}").json()
    assert detail["policy_version"] == 2 and detail["ledger"]["units"]["completed"] == 12
    assert detail["latest_metrics"]["reward_mean"]["step"] == 2
    assert detail["latest_metrics"]["reward_mean"]["value"] == pytest.approx(0.6)
    assert set(detail["pass_at_k"]) == {"pass@1", "pass@2"}  # k up to samples_per_task
    assert 0 < detail["pass_at_k"]["pass@1"] <= detail["pass_at_k"]["pass@2"] <= 1
    # malformed tool calls: the seeded wrong answers came after two each (the trajectories' `info`)
    wrong = [t for t in client.get(f"/v1/runs/{run_id}/trajectories", params={"limit": 100}).json()["data"]
             if t["reward"] == 0]
    assert wrong and detail["tool_call_errors"] == 2 * len(wrong)
    assert client.get(f"/v1/runs/{seed_run(database_url, name='no-tools', versions=0)}").json()["tool_call_errors"] == 0
    series = client.get(f"/v1/runs/{run_id}/metrics", params={"name": ["ppo_kl"]}).json()["series"]
    assert list(series) == ["ppo_kl"] and [p["step"] for p in series["ppo_kl"]] == [0, 1, 2]
    assert set(client.get(f"/v1/runs/{run_id}/metrics").json()["series"]) == {name for name, _ in trainer_metrics(0)}
    ckpts = client.get(f"/v1/runs/{run_id}/checkpoints").json()["data"]
    assert [c["version"] for c in ckpts] == [0, 1, 2]
    rewards = client.get(f"/v1/runs/{run_id}/rewards").json()["data"]
    assert [r["policy_version"] for r in rewards] == [0, 1, 2] and rewards[2]["mean_reward"] == 1.0
    for sub in ("metrics", "checkpoints", "rewards", "events", "trajectories"):
        assert client.get(f"/v1/runs/{uuid.uuid4()}/{sub}").status_code == 404


def test_tokens_and_scopes(api, client, dataset):
    r = client.post("/v1/tokens", json={"name": "reader", "scopes": ["read"]})
    assert r.status_code == 201
    reader = r.json()
    with api.client(reader["token"]) as rc:
        assert rc.get("/v1/runs").status_code == 200
        assert rc.post("/v1/runs", json=run_config(dataset)).status_code == 403
        assert rc.post("/v1/sql", json={"query": "select 1 as one"}).json()["rows"] == [[1]]
        assert rc.get("/v1/tokens").status_code == 403
    writer = client.post("/v1/tokens", json={"name": "writer", "scopes": ["write"]}).json()
    with api.client(writer["token"]) as wc:
        assert wc.post("/v1/runs", json=run_config(dataset)).status_code == 201
        assert wc.post("/v1/tokens", json={"name": "x"}).status_code == 403
    listed = client.get("/v1/tokens").json()["data"]
    assert "token" not in listed[0] and {"reader", "writer"} <= {t["name"] for t in listed}
    assert client.delete(f"/v1/tokens/{reader['id']}").json()["revoked_at"]
    with api.client(reader["token"]) as rc:
        assert rc.get("/v1/runs").status_code == 401
    assert client.post("/v1/tokens", json={"name": "x", "scopes": ["root"]}).status_code == 422
    assert client.delete(f"/v1/tokens/{uuid.uuid4()}").status_code == 404


def test_sql_endpoint_is_read_only(client, database_url):
    seed_run(database_url, name="sql")
    r = client.post("/v1/sql", json={"query": "select count(*) as n from trajectory_summary"})
    assert r.status_code == 200 and r.json()["columns"] == ["n"] and r.json()["rows"][0][0] > 0
    for query in ("delete from runs", "select 1; delete from runs", "set role postgres",
                  "select set_config('role', 'postgres', true)", "select * from api_tokens", "selec 1"):
        r = client.post("/v1/sql", json={"query": query})
        assert r.status_code == 400, (query, r.text)
    assert client.get("/v1/runs").json()["count"] > 0  # nothing was deleted
    r = client.post("/v1/sql", json={"query": "select g from generate_series(1, 50) g", "max_rows": 10})
    assert len(r.json()["rows"]) == 10 and r.json()["truncated"] is True


def test_jobs_routes_validate(client):
    assert client.get(f"/v1/jobs/{uuid.uuid4()}").status_code == 404
    r = client.post("/v1/datasets/import", json={"name": "x"})
    assert r.status_code == 422 and "exactly one" in r.text
    r = client.post("/v1/evals", json={"config": run_config("arith"), "checkpoint_run_id": str(uuid.uuid4())})
    assert r.status_code == 404 and "checkpoint_run_id" in r.text
