"""Uploads and deletes of datasets wait for no one: the jobs worker stores datasets, and with none running an
upload or a delete is answered 202 with its job, which a worker started later carries out. A module of its own:
any jobs worker of another module's fixture would take the job at once (they share the session's Redis).

    pytest -q tests/integration/test_dataset_jobs.py
"""

from __future__ import annotations

import json
import uuid
from pathlib import Path

from api_testlib import running_api, start_jobs

from harness.procs import stop, wait_until
from shared.datasets import DatasetRegistry
from shared.db.session import make_engine


def test_an_upload_and_a_delete_no_jobs_worker_takes_yet_are_queued_not_lost(isolated_urls, tmp_path):
    """The jobs worker stores datasets: with none running, an upload and a delete answer 202 with their job, and a
    worker started later carries both out; the uploaded file is gone once imported. (Isolated: a job other
    modules left queued would otherwise be the late worker's first.)"""
    redis_url, database_url = isolated_urls
    name, engine = f"ds-{uuid.uuid4().hex[:8]}", make_engine(database_url)
    with running_api(database_url, redis_url, tmp_path, controller=False, DATASET_JOB_WAIT_S="0.5") as live, \
            live.client() as client:
        queued = upload(client, name, [{"id": f"q{i}", "question": str(i)} for i in range(4)], expect=202)
        assert queued["kind"] == "import_dataset" and queued["status"] == "queued"
        assert list((tmp_path / "uploads").iterdir()) == [Path(queued["params"]["path"])]
        worker = start_jobs(database_url, redis_url, tmp_path, WORKER_ID="jobs-late")
        try:
            done = wait_until(lambda: (j := client.get(f"/v1/jobs/{queued['id']}").json())["status"] == "succeeded"
                              and j, 60, "the queued upload to be imported", procs=[worker])
            assert done["result"]["version"] == 1 and done["result"]["num_rows"] == 4
            assert DatasetRegistry(engine).load(name, "train").task_ids == ["q0", "q1", "q2", "q3"]
            assert list((tmp_path / "uploads").iterdir()) == []
            stop(worker)
            gone = client.delete(f"/v1/datasets/{name}")
            assert gone.status_code == 202 and gone.json()["kind"] == "delete_dataset", gone.text
            assert DatasetRegistry(engine).versions(name, "train") != []  # nothing deleted without a worker
            worker = start_jobs(database_url, redis_url, tmp_path, WORKER_ID="jobs-late-2")
            wait_until(lambda: client.get(f"/v1/datasets/{name}").status_code == 404, 60, "the queued delete",
                       procs=[worker])
            assert client.get(f"/v1/jobs/{gone.json()['id']}").json()["result"] == {"deleted": 1}
        finally:
            stop(worker)
            engine.dispose()


def upload(client, name: str, rows: list[dict], expect: int) -> dict:
    body = "\n".join(json.dumps(r) for r in rows).encode()
    r = client.post("/v1/datasets", data={"name": name}, files={"file": (f"{name}.jsonl", body)})
    assert r.status_code == expect, r.text
    return r.json()
