"""Datasets a run depends on never change under it: versions are immutable, re-import adds a version, a run pins
the version it was created with (the controller reads that version's rows, also after a restart), and a version
that a live run reads cannot be deleted.

    pytest -q tests/component/test_dataset_versions.py
"""

from __future__ import annotations

import asyncio
import json
import signal
import uuid

import pytest
from api_testlib import run_config, running_api
from sqlalchemy import insert
from test_controller_runs import FakeRolloutWorker, controllers, run_row, set_run, start_controller  # noqa: F401 (fixtures)

from shared.contracts.db.models import Run
from shared.platform.db.session import make_engine
from shared.stores.datasets import DatasetInUse, DatasetNotFound, DatasetRegistry
from tests.support.procs import wait_until_async


@pytest.fixture(scope="module")
def engine(database_url):
    eng = make_engine(database_url)
    yield eng
    eng.dispose()


@pytest.fixture(scope="module")
def api(database_url, redis_url, tmp_path_factory):
    with running_api(database_url, redis_url, tmp_path_factory.mktemp("api"), jobs=True) as live:
        yield live


@pytest.fixture(scope="module")
def client(api):
    with api.client() as c:
        yield c


def rows(prefix: str, n: int) -> list[dict]:
    return [{"id": f"{prefix}{i}", "question": f"{prefix} {i}", "answer": str(i)} for i in range(n)]


def upload(client, name: str, data: list[dict], expect: int = 201) -> dict:
    body = "\n".join(json.dumps(r) for r in data).encode()
    r = client.post("/v1/datasets", data={"name": name}, files={"file": (f"{name}.jsonl", body)})
    assert r.status_code == expect, r.text
    return r.json()


def live_run(engine, dataset: str, version: int | None, status: str = "running") -> str:
    config = dict(name="r", model="m", dataset=dataset, agent={"name": "math"}, env={"name": "math"})
    if version is not None:
        config["dataset_version"] = version
    run_id = uuid.uuid4()
    with engine.begin() as c:
        c.execute(insert(Run).values(id=run_id, name="r", kind="eval", status=status, config=config))
    return str(run_id)


def test_reimport_adds_a_version_and_keeps_the_old_rows(engine):
    reg, name = DatasetRegistry(engine), f"ds-{uuid.uuid4().hex[:8]}"
    assert reg.register(name, rows("old", 20))["version"] == 1
    assert reg.register(name, rows("new", 5))["version"] == 2
    assert len(reg.load(name)) == 5 and reg.load(name).version == 2
    first = reg.load(name, version=1)
    assert first.task_ids == [f"old{i}" for i in range(20)] and first.rows == rows("old", 20)
    assert [v["num_rows"] for v in reg.versions(name, "train")] == [20, 5]
    listed = next(d for d in reg.list() if d["name"] == name)
    assert listed["version"] == 2 and listed["versions"] == [1, 2]
    with pytest.raises(DatasetNotFound, match="train v1, train v2"):
        reg.load(name, version=3)


def test_a_version_a_live_run_reads_cannot_be_deleted(engine):
    reg, name = DatasetRegistry(engine), f"ds-{uuid.uuid4().hex[:8]}"
    reg.register(name, rows("a", 3))
    reg.register(name, rows("b", 3))
    pinned = live_run(engine, name, 1)
    unpinned = live_run(engine, name, None, status="paused")  # no version in its config: it reads the latest
    with pytest.raises(DatasetInUse, match=pinned) as refused:
        reg.delete(name, "train", version=1)
    assert "stop those runs" in str(refused.value)
    with pytest.raises(DatasetInUse, match=unpinned):
        reg.delete(name, "train", version=2)
    with pytest.raises(DatasetInUse):
        reg.delete(name)  # every version, some in use: nothing goes
    assert [v["version"] for v in reg.versions(name, "train")] == [1, 2]

    set_run(engine, pinned, status="completed")
    assert reg.delete(name, "train", version=1) == 1  # finished runs pin nothing
    set_run(engine, unpinned, status="stopped")
    assert reg.delete(name) == 1
    assert reg.versions(name, "train") == []


def test_api_pins_the_version_and_refuses_deleting_it(client, engine):
    name = f"ds-{uuid.uuid4().hex[:8]}"
    upload(client, name, rows("a", 4))
    assert upload(client, name, rows("b", 2))["version"] == 2
    run = client.post("/v1/runs", json=run_config(name)).json()
    assert run["config"]["dataset_version"] == 2  # the latest, recorded at creation
    set_run(engine, run["id"], status="stopped")  # no controller here: keep it out of the next test's way
    old = client.post("/v1/runs", json=run_config(name, kind="eval", samples_per_task=1, dataset_version=1)).json()
    assert old["config"]["dataset_version"] == 1
    assert client.get(f"/v1/runs/{old['id']}").json()["progress"]["total"] == 4  # v1's rows, not v2's
    missing = client.post("/v1/runs", json=run_config(name) | {"dataset_version": 9})
    assert missing.status_code == 404 and "version 9" in missing.text

    assert client.get(f"/v1/datasets/{name}/rows", params={"version": 1}).json()["data"][0]["task_id"] == "a0"
    assert [v["version"] for v in client.get(f"/v1/datasets/{name}").json()["splits"]["train"]["versions"]] == [1, 2]
    refused = client.delete(f"/v1/datasets/{name}", params={"split": "train", "version": 1})
    assert refused.status_code == 409 and old["id"] in refused.text
    assert client.post(f"/v1/runs/{old['id']}/stop").status_code == 200
    set_run(engine, old["id"], status="stopped")
    assert client.delete(f"/v1/datasets/{name}", params={"split": "train", "version": 1}).status_code == 204


async def test_reimport_while_a_run_runs_leaves_its_rows_unchanged(client, engine, redis_client, start_controller):  # noqa: F811
    """200 rows, a run dispatching them, a re-import with 50 other rows, the controller restarted (its plan is
    rebuilt from the database): every task the run dispatches is one of the 200 original rows, and it completes
    with all 200."""
    name = f"ds-{uuid.uuid4().hex[:8]}"
    original = {r["id"]: r for r in rows("orig", 200)}
    upload(client, name, list(original.values()))
    run_id = client.post("/v1/runs", json=run_config(name, kind="eval", samples_per_task=1, max_in_flight=8)).json()["id"]

    controller = start_controller()
    async with FakeRolloutWorker(redis_client, run_id, lambda t: "correct", hold_s=0.05) as worker:
        await wait_until_async(lambda: len(worker.received) >= 16, 30, "first dispatches")
        worker.paused = True
        upload(client, name, rows("imposter", 50))  # re-import the name while the run runs
        controller.send_signal(signal.SIGTERM)
        controller.wait(30)
        start_controller()  # a fresh controller rebuilds the run's plan from Postgres
        worker.paused = False
        await wait_until_async(lambda: run_row(engine, run_id).status == "completed", 90, "run completed")
        await asyncio.sleep(0.3)
    seen = {t.task_id: t.task for t in worker.received}
    assert set(seen) == set(original), f"tasks not from the pinned version: {sorted(set(seen) - set(original))[:5]}"
    assert all(seen[k] == original[k] for k in seen)
    assert run_row(engine, run_id).summary["num_tasks"] == 200


def test_a_redelivered_import_job_finds_its_version_instead_of_adding_one(engine, tmp_path):
    from services.jobs.tasks import JobContext, import_dataset
    from shared.contracts.db.models import Job

    name = f"ds-{uuid.uuid4().hex[:8]}"
    (tmp_path / "rows.jsonl").write_text("\n".join(json.dumps(r) for r in rows("x", 3)))
    job = Job(id=uuid.uuid4(), params={"name": name, "path": str(tmp_path / "rows.jsonl")})
    ctx = JobContext(config=None, engine=engine)
    assert import_dataset(ctx, job)["version"] == 1
    assert import_dataset(ctx, job)["version"] == 1  # at-least-once delivery: the same job ran again
    assert len(DatasetRegistry(engine).versions(name, "train")) == 1

