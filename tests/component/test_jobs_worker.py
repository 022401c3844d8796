"""Background jobs through a real Celery worker process (`python -m services.jobs.main`, Redis broker) and the
live API: dataset import (jsonl, csv, HF folder, built-in generator, bad file), evaluation of a checkpoint
(creates an eval run), parquet export loadable with HF `datasets`, checkpoint GC (through a real weight server) + stream retention.

    pytest -q tests/component/test_jobs_worker.py
"""

from __future__ import annotations

import hashlib
import json
import time
import uuid
from pathlib import Path

import httpx
import pytest
import redis
from api_testlib import run_config, seed_run, start_api, start_jobs
from sqlalchemy import create_engine
from trainer_testlib import WeightServer

from infra.local.ports import free_port
from shared.contracts import streams
from shared.contracts.messages import JobRequest, JobRequestReply
from shared.platform.bus import announce, await_answer
from tests.support.procs import stop, wait_until


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("jobs-data")


@pytest.fixture(scope="module")
def api(database_url, redis_url, data_dir):
    live = start_api(database_url, redis_url, data_dir)
    yield live
    live.stop()


@pytest.fixture(scope="module")
def weight_server(database_url, redis_url, data_dir):
    server = WeightServer(redis_url, database_url, data_dir / "weights", keep_last=100).start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def worker(database_url, redis_url, data_dir, weight_server):
    proc = start_jobs(database_url, redis_url, data_dir, WORKER_ID="jobs-test", WEIGHT_SERVER_URL=weight_server.url)
    yield proc
    stop(proc)
    assert proc.returncode == 0


@pytest.fixture(scope="module")
def client(api, worker):
    with api.client() as c:
        yield c


def finished_job(client, job: dict, timeout_s: float = 60) -> dict:
    def done():
        j = client.get(f"/v1/jobs/{job['id']}").json()
        return j if j["status"] in ("succeeded", "failed") else None

    return wait_until(done, timeout_s, f"job {job['id']} to finish", interval_s=0.2)


def test_worker_health_and_heartbeat(worker, redis_url):
    beat = wait_until(lambda: redis.Redis.from_url(redis_url).get("heartbeat:jobs:jobs-test"), 30, "its heartbeat")
    port = json.loads(beat)["port"]
    assert httpx.get(f"http://127.0.0.1:{port}/healthz").status_code == 200
    ready = httpx.get(f"http://127.0.0.1:{port}/readyz")
    assert ready.status_code == 200 and ready.json()["redis"] is True and ready.json()["postgres"] is True
    assert "service_up" in httpx.get(f"http://127.0.0.1:{port}/metrics").text


def test_reimport_job_adds_a_version_and_a_redelivered_job_does_not(client, tmp_path):
    (tmp_path / "a.jsonl").write_text('{"id": "a"}\n{"id": "b"}\n')
    first = finished_job(client, client.post("/v1/datasets/import", json={"name": "re-imp", "path": str(tmp_path / "a.jsonl")}).json())
    again = finished_job(client, client.post("/v1/datasets/import", json={"name": "re-imp", "path": str(tmp_path / "a.jsonl")}).json())
    assert (first["result"]["version"], again["result"]["version"]) == (1, 2)
    versions = client.get("/v1/datasets/re-imp").json()["splits"]["train"]["versions"]
    assert [(v["version"], v["num_rows"]) for v in versions] == [(1, 2), (2, 2)]


def ask(r, kind: str, params: dict, *, times: int = 1, expires_in_s: float = 10.0) -> tuple[str, JobRequestReply]:
    """A `JobRequest` sent on `jobs.requests` `times` times (a redelivery), and the intake's answer."""
    now = time.time()
    req = JobRequest(job_id=str(uuid.uuid4()), kind=kind, params=params, sent_at=now, expires_at=now + expires_in_s)
    for _ in range(times):
        announce(r, streams.JOB_REQUESTS, req)
    answer = await_answer(r, streams.job_reply(req.job_id), JobRequestReply, time.monotonic() + 30)
    assert answer is not None, f"the intake did not answer the {kind} request"
    return req.job_id, answer


def test_a_request_delivered_twice_is_one_job_and_one_version(client, worker, redis_url):
    """The intake stores a request under the id its sender chose: a second delivery finds the row (no duplicate-key
    failure, no dead letter) and the job's effect happens once."""
    r = redis.Redis.from_url(redis_url)
    job_id, answer = ask(r, "import_dataset", {"name": "twice", "generator": "arithmetic", "n": 3}, times=2)
    assert answer.outcome == "queued"
    assert finished_job(client, {"id": job_id})["status"] == "succeeded"
    wait_until(lambda: r.xpending(streams.JOB_REQUESTS, streams.GROUP_JOBS)["pending"] == 0, 30,
               "both deliveries to be acknowledged")
    versions = client.get("/v1/datasets/twice").json()["splits"]["train"]["versions"]
    assert [v["version"] for v in versions] == [1]
    assert r.xlen(streams.dead_letter(streams.JOB_REQUESTS)) == 0


def test_an_expired_request_is_stored_nowhere_and_an_unknown_kind_is_a_failed_job(client, worker, redis_url):
    r = redis.Redis.from_url(redis_url)
    job_id, answer = ask(r, "gc", {"keep_checkpoints": 1}, expires_in_s=-1)  # its sender has given up
    assert answer.outcome == "expired"
    assert client.get(f"/v1/jobs/{job_id}").status_code == 404
    job_id, answer = ask(r, "reindex", {})
    assert answer.outcome == "queued"
    job = client.get(f"/v1/jobs/{job_id}").json()
    assert job["status"] == "failed" and "unknown job kind 'reindex'" in job["error"] and "import_dataset" in job["error"]


def test_import_jsonl_csv_and_hf_folder(client, tmp_path):
    import datasets

    (tmp_path / "a.jsonl").write_text("\n".join(json.dumps({"id": i, "q": f"{i}?"}) for i in range(7)))
    (tmp_path / "b.csv").write_text("task_id,question\nx,1?\ny,2?\n")
    datasets.Dataset.from_list([{"question": "hf?", "answer": "1"}] * 3).save_to_disk(str(tmp_path / "hf"))
    for name, path, n in (("imp-jsonl", "a.jsonl", 7), ("imp-csv", "b.csv", 2), ("imp-hf", "hf", 3)):
        job = client.post("/v1/datasets/import", json={"name": name, "path": str(tmp_path / path)})
        # the answer shows the job as read when the intake answered: the worker may have taken it up already
        assert job.status_code == 202 and job.json()["status"] in ("queued", "running", "succeeded")
        done = finished_job(client, job.json())
        assert done["status"] == "succeeded", done["error"]
        assert done["result"]["num_rows"] == n
        assert client.get(f"/v1/datasets/{name}").json()["splits"]["train"]["num_rows"] == n
    assert client.get("/v1/datasets/imp-csv/rows").json()["data"][1]["task_id"] == "y"


def test_import_from_builtin_generator(client):
    job = client.post("/v1/datasets/import", json={"name": "gen-arith", "generator": "arithmetic", "n": 12, "seed": 3})
    done = finished_job(client, job.json())
    assert done["status"] == "succeeded", done["error"]
    assert client.get("/v1/datasets/gen-arith/rows", params={"limit": 100}).json()["data"].__len__() == 12
    bad = finished_job(client, client.post("/v1/datasets/import", json={"name": "g2", "generator": "nope"}).json())
    assert bad["status"] == "failed" and "nope" in bad["error"]


def test_bad_import_fails_the_job_with_the_reason(client, tmp_path):
    (tmp_path / "bad.jsonl").write_text('{"a": 1}\n[1, 2]\n')
    bad = finished_job(client, client.post("/v1/datasets/import",
                                           json={"name": "bad", "path": str(tmp_path / "bad.jsonl")}).json())
    assert bad["status"] == "failed" and "row 1: expected a JSON object" in bad["error"]
    missing = finished_job(client, client.post("/v1/datasets/import", json={"name": "bad", "path": "/nope.jsonl"}).json())
    assert missing["status"] == "failed" and "no such file" in missing["error"]
    assert client.get("/v1/datasets/bad").status_code == 404


def test_evaluate_checkpoint_creates_eval_run(client, database_url, tmp_path):
    """The job creates the run through shared/clients/run_commands.py, with the checks POST /v1/runs makes."""
    (tmp_path / "e.jsonl").write_text("\n".join(json.dumps({"id": i, "question": f"{i}+1", "answer": str(i + 1)})
                                                for i in range(3)))
    finished_job(client, client.post("/v1/datasets/import", json={"name": "eval-ds", "path": str(tmp_path / "e.jsonl")}).json())
    source = seed_run(database_url, name="trained", status="completed")
    body = {"config": run_config("eval-ds", name="eval-of-trained", samples_per_task=4), "checkpoint_run_id": str(source),
            "checkpoint_version": 1}
    done = finished_job(client, client.post("/v1/evals", json=body).json())
    assert done["status"] == "succeeded", done["error"]
    run = client.get(f"/v1/runs/{done['result']['run_id']}").json()
    assert run["kind"] == "eval" and run["status"] == "pending" and run["name"] == "eval-of-trained@v1"
    assert run["config"]["model"] == f"file:///weights/{source}/v1" and done["run_id"] == run["id"]
    body["config"]["dataset"] = "missing"
    failed = finished_job(client, client.post("/v1/evals", json=body).json())
    assert failed["status"] == "failed" and "missing" in failed["error"]
    (tmp_path / "q.jsonl").write_text("\n".join(json.dumps({"id": i, "question": f"{i}+1"}) for i in range(3)))
    finished_job(client, client.post("/v1/datasets/import", json={"name": "no-answers", "path": str(tmp_path / "q.jsonl")}).json())
    body["config"]["dataset"] = "no-answers"
    refused = finished_job(client, client.post("/v1/evals", json=body).json())
    assert refused["status"] == "failed" and refused["run_id"] is None
    assert "dataset: env 'math' needs a" in refused["error"], refused["error"]


def test_export_to_parquet_loads_with_hf_datasets(client, database_url):
    import datasets

    run_id = seed_run(database_url, name="export", num_tasks=2, samples=2, versions=2)
    job = client.post(f"/v1/runs/{run_id}/export")
    assert job.status_code == 202
    done = finished_job(client, job.json())
    assert done["status"] == "succeeded", done["error"]
    ds = datasets.Dataset.from_parquet(done["result"]["path"])
    assert len(ds) == 8 == done["result"]["num_rows"]
    row = ds[0]
    assert row["run_id"] == str(run_id) and row["response_ids"] == [4, 5, 6]
    assert json.loads(row["steps"])[0]["chat_completions"][0]["role"] == "user"
    assert client.post(f"/v1/runs/{uuid.uuid4()}/export").status_code == 404


def _publish(url: str, run_id: uuid.UUID, version: int, base: int | None = None) -> None:
    """Version `version` of `run_id` on the weight server: a full snapshot, or a delta on `base`."""
    data = f"weights v{version}".encode()
    assert httpx.put(f"{url}/v1/runs/{run_id}/versions/{version}/files/model.safetensors", content=data,
                     params={"sha256": hashlib.sha256(data).hexdigest()}).status_code == 200
    layout = {"kind": "delta", "base_version": base,
              "tensors": {"w": {"xxh3_128": "0" * 32, "dtype": "float32", "shape": [1]}}} if base else {}
    r = httpx.post(f"{url}/v1/runs/{run_id}/versions/{version}/publish",
                   json={"files": {"model.safetensors": hashlib.sha256(data).hexdigest()}, **layout})
    assert r.status_code == 200, r.text


def test_gc_keeps_newest_checkpoints_with_what_they_are_built_on_and_trims_streams(
        client, database_url, redis_url, weight_server, request):
    """The weight server deletes (it owns checkpoints): of a finished run's v1 (full), v2 (full), v3 (delta on
    v2), v4 (delta on v3), keeping the newest one keeps v2 and v3 too, since v4 is built on them."""
    run_id = seed_run(database_url, name="gc", status="completed", versions=1)  # v0: a row without files
    for version, base in ((1, None), (2, None), (3, 2), (4, 3)):
        _publish(weight_server.url, run_id, version, base)
    live = seed_run(database_url, name="gc-live", status="running", versions=3)
    r = redis.Redis.from_url(redis_url)
    # A stream no service of this module consumes: the API's controller reads `trajectories` (and would recreate
    # its group, or take these entries, under the test), and nothing here reads env requests.
    stream = streams.ENV_REQUESTS
    r.delete(stream)
    request.addfinalizer(lambda: r.delete(stream))  # its {"i": n} entries are no EnvRequests: never leave them
    r.xgroup_create(stream, "env-workers", id="0", mkstream=True)
    for i in range(5):
        r.xadd(stream, {"i": i})
    r.xreadgroup("env-workers", "c1", {stream: ">"}, count=5)
    r.xack(stream, "env-workers", *[e[0] for e in r.xrange(stream)][:3])

    done = finished_job(client, client.post("/v1/jobs/gc", json={"keep_checkpoints": 1}).json())
    assert done["status"] == "succeeded", done["error"]
    deleted = done["result"]["deleted_checkpoints"]  # earlier tests' finished runs lose their older rows too
    assert sorted(d for d in deleted if d.startswith(str(run_id))) == [f"{run_id}/v0", f"{run_id}/v1"]
    assert not any(d.startswith(str(live)) for d in deleted)
    weights = weight_server.env["WEIGHTS_DIR"]
    assert [(Path(weights) / str(run_id) / f"v{v}").is_dir() for v in range(1, 5)] == [False, True, True, True]
    statuses = {c["version"]: c["status"] for c in client.get(f"/v1/runs/{run_id}/checkpoints").json()["data"]}
    assert statuses == {0: "deleted", 1: "deleted", 2: "available", 3: "available", 4: "available"}
    for version in (2, 3, 4):  # what is kept still downloads
        assert httpx.get(f"{weight_server.url}/v1/runs/{run_id}/versions/{version}/MANIFEST.json").status_code == 200
    kept = {c["status"] for c in client.get(f"/v1/runs/{live}/checkpoints").json()["data"]}
    assert kept == {"available"}  # a running run keeps everything
    assert done["result"]["trimmed"][stream] == 3 and r.xlen(stream) == 2


def test_gc_without_the_weight_server_fails_the_job_and_says_where_it_looked(database_url, redis_url, data_dir):
    """GC of a finished run's checkpoints needs their owner: unreachable, the job fails with WEIGHT_SERVER_URL in
    its error, and the worker lives on."""
    from services.jobs.settings import JobsSettings
    from services.jobs.tasks import JobContext, _gc_checkpoints

    seed_run(database_url, name="gc-nobody", status="stopped", versions=3)
    engine = create_engine(database_url)
    config = JobsSettings(database_url=database_url, redis_url=redis_url, data_dir=data_dir,
                        weight_server_url=f"http://127.0.0.1:{free_port()}")
    with pytest.raises(RuntimeError, match="WEIGHT_SERVER_URL"):
        _gc_checkpoints(JobContext(config, engine), keep=1)
    engine.dispose()


def test_jobs_list(client):
    kinds = {j["kind"] for j in client.get("/v1/jobs", params={"limit": 100}).json()["data"]}
    assert {"import_dataset", "evaluate", "export"} <= kinds
