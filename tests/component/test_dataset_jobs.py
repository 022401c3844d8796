"""Uploads and deletes of datasets are jobs of the jobs service, the one writer of `datasets` and of `jobs`: with no
jobs service to queue them they are refused (503) and leave nothing behind, not even for a service started later;
with DATASET_JOB_WAIT_S=0 they answer 202 with their job at once, and the job carries them out. A module of its
own, on isolated Redis and Postgres: a jobs service of another module's fixture would take the requests.

    pytest -q tests/component/test_dataset_jobs.py
"""

from __future__ import annotations

import json
import uuid

import redis
from api_testlib import running_api, start_jobs

from shared.contracts import streams
from shared.platform.db.session import make_engine
from shared.stores.datasets import DatasetRegistry
from tests.support.procs import stop, wait_until


def test_with_no_jobs_service_an_upload_is_refused_and_nothing_is_queued(isolated_urls, tmp_path):
    """503 naming the jobs service; the uploaded file removed; no `jobs` row; and a jobs service started afterwards
    reads the request late and stores nothing (its sender told the caller nothing was queued)."""
    redis_url, database_url = isolated_urls
    name, engine = f"ds-{uuid.uuid4().hex[:8]}", make_engine(database_url)
    with running_api(database_url, redis_url, tmp_path, controller=False, JOB_REQUEST_WAIT_S="0.5") as live, \
            live.client() as client:
        r = upload(client, name, [{"id": "a", "question": "1"}])
        assert r.status_code == 503 and "no jobs service took the import_dataset job" in r.text, r.text
        assert list((tmp_path / "uploads").iterdir()) == []
        gc = client.post("/v1/jobs/gc", json={"keep_checkpoints": 1})
        assert gc.status_code == 503 and "nothing was queued" in gc.text, gc.text
        worker = start_jobs(database_url, redis_url, tmp_path, WORKER_ID="jobs-late")
        try:
            bus = redis.Redis.from_url(redis_url)
            wait_until(lambda: _all_read(bus), 60, "the late intake to read both requests", procs=[worker])
            assert client.get("/v1/jobs").json()["count"] == 0
            assert client.get(f"/v1/datasets/{name}").status_code == 404
        finally:
            stop(worker)
            engine.dispose()


def test_an_upload_and_a_delete_answer_202_at_once_and_their_jobs_carry_them_out(isolated_urls, tmp_path):
    redis_url, database_url = isolated_urls
    name, engine = f"ds-{uuid.uuid4().hex[:8]}", make_engine(database_url)
    with running_api(database_url, redis_url, tmp_path, controller=False, jobs=True, DATASET_JOB_WAIT_S="0") as live, \
            live.client() as client:
        r = upload(client, name, [{"id": f"q{i}", "question": str(i)} for i in range(4)])
        assert r.status_code == 202, r.text
        queued = r.json()
        assert queued["kind"] == "import_dataset" and queued["status"] in ("queued", "running", "succeeded")
        done = wait_until(lambda: (j := client.get(f"/v1/jobs/{queued['id']}").json())["status"] == "succeeded"
                          and j, 60, "the upload to be imported", procs=[live.jobs])
        assert done["result"]["version"] == 1 and done["result"]["num_rows"] == 4
        assert DatasetRegistry(engine).load(name, "train").task_ids == ["q0", "q1", "q2", "q3"]
        assert list((tmp_path / "uploads").iterdir()) == []  # the job removed the file it imported
        gone = client.delete(f"/v1/datasets/{name}")
        assert gone.status_code == 202 and gone.json()["kind"] == "delete_dataset", gone.text
        wait_until(lambda: client.get(f"/v1/datasets/{name}").status_code == 404, 60, "the delete",
                   procs=[live.jobs])
        assert client.get(f"/v1/jobs/{gone.json()['id']}").json()["result"] == {"deleted": 1}
    engine.dispose()


def _all_read(bus) -> bool:
    """Every request on `jobs.requests` delivered to the intake's group and acknowledged."""
    if not bus.exists(streams.JOB_REQUESTS):
        return False
    last = bus.xinfo_stream(streams.JOB_REQUESTS)["last-generated-id"]
    return any(g["name"] in (streams.GROUP_JOBS, streams.GROUP_JOBS.encode()) and g["pending"] == 0
               and g["last-delivered-id"] == last for g in bus.xinfo_groups(streams.JOB_REQUESTS))


def upload(client, name: str, rows: list[dict]):
    body = "\n".join(json.dumps(r) for r in rows).encode()
    return client.post("/v1/datasets", data={"name": name}, files={"file": (f"{name}.jsonl", body)})
