"""End-to-end evaluation over real Redis/Postgres: controller, rollout worker (HF engine, tiny random-init
model) and env worker as real processes; the run completes with pass@k stored and every trajectory stored
token-exact."""

from __future__ import annotations

import multiprocessing
import time
import uuid
from pathlib import Path

import pytest
from sqlalchemy import insert, text

from services.controller.run_summary import ledger_summary
from shared.contracts.db.models import Dataset, DatasetRow, Run
from shared.platform.db.session import make_engine
from tests.support.live import wait_run_ended
from tests.support.procs import ServiceGroup

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.skipif(not (REPO / "services" / "rollout_worker" / "main.py").exists(),
                                reason="the rollout worker has not landed yet")


@pytest.fixture
def services(isolated_urls, tmp_path):
    """Start services by module name; all stopped afterwards. Isolated: a controller on the shared database
    would resume earlier modules' runs."""
    redis_url, database_url = isolated_urls
    group = ServiceGroup(tmp_path, redis_url=redis_url, database_url=database_url, data_dir=str(tmp_path / "data"))
    yield lambda module, **env: group.start(module.split(".")[1], module, **env)
    group.stop()


def eval_setup(database_url: str, tmp_path, name: str, tasks: int, seed: int, **config):
    """A tiny random-init model, an arithmetic dataset of `tasks` rows stored in Postgres, and an eval run's
    config over them (`config` overrides the defaults). Returns (engine, run id, config)."""
    from services.jobs.builtin_datasets import generate
    from tests.support.tiny_model import build_tiny_model

    model = str(build_tiny_model(tmp_path / "model"))
    engine = make_engine(database_url)
    rows, ds, dataset = generate("arithmetic", tasks, seed=seed), uuid.uuid4(), f"{name}-{uuid.uuid4().hex[:6]}"
    config = {"name": name, "kind": "eval", "model": model, "dataset": dataset, "dataset_split": "test",
              "agent": {"name": "math"}, "env": {"name": "math"}, "engine": {"type": "hf"},
              "max_prompt_tokens": 256, "max_response_tokens": 8, **config}
    with engine.begin() as c:
        c.execute(insert(Dataset).values(id=ds, name=dataset, split="test", source="generator", num_rows=tasks, info={}))
        c.execute(insert(DatasetRow), [dict(dataset_id=ds, idx=i, task_id=r["id"], data=r,
                                            data_source=r["data_source"]) for i, r in enumerate(rows)])
    return engine, uuid.uuid4(), config


def test_eval_run_end_to_end_with_hf_engine(isolated_urls, services, tmp_path):
    engine, run_id, config = eval_setup(isolated_urls[1], tmp_path, "e2e-eval", 4, seed=3, samples_per_task=2,
                                        max_in_flight=4, trajectory_timeout_s=120.0)
    with engine.begin() as c:
        c.execute(insert(Run).values(id=run_id, name="e2e-eval", kind="eval", status="pending", config=config))
    services("services.env_worker.main", WORKER_ID="e2e-env")
    services("services.rollout_worker.main", WORKER_ID="e2e-rollout")
    services("services.controller.main", WORKER_ID="e2e-ctl")

    status = wait_run_ended(engine, str(run_id), 180)
    with engine.connect() as c:
        summary, error = c.execute(text("SELECT summary, error FROM runs WHERE id = :r"), {"r": run_id}).one()
    assert status == "completed", f"{status}: {error}; logs in {tmp_path}"
    assert summary["num_tasks"] == 4 and summary["n"] == 2
    assert set(summary["pass@k"]) == {"1", "2"} and set(summary["by_source"]) == {"arithmetic"}
    assert all(0.0 <= v <= 1.0 for v in summary["pass@k"].values())
    with engine.connect() as c:
        assert ledger_summary(c, run_id)["completed"] == 8
        arrays = c.execute(text(
            """SELECT a.prompt_ids, a.response_ids, a.logprobs, a.loss_mask FROM token_arrays a
               JOIN trajectories t ON t.id = a.trajectory_id WHERE t.run_id = :r AND a.step_idx = -1"""),
            {"r": run_id}).all()
        correct = c.execute(text("SELECT count(*) FILTER (WHERE is_correct) FROM episodes WHERE run_id = :r"),
                            {"r": run_id}).scalar_one()
    assert len(arrays) == 8
    for prompt_ids, response_ids, logprobs, loss_mask in arrays:
        assert prompt_ids and 0 < len(response_ids) == len(logprobs) == len(loss_mask)
    assert summary["pass@k"]["1"] == pytest.approx(correct / 8)
    engine.dispose()


def burn_cpu(seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        pass


def test_eval_under_a_cpu_burning_neighbour_requeues_nothing_and_never_stalls(isolated_urls, services, tmp_path):
    """Two processes burn both cores while the eval runs, and each task's lease (trajectory_timeout_s, no margin)
    is shorter than a loaded worker takes to load the model and run the first wave: the worker lists what it
    runs in its heartbeat, the controller renews those leases, so no unit is lost, re-run, or called stalled."""
    engine, run_id, config = eval_setup(isolated_urls[1], tmp_path, "loaded-eval", 6, seed=5, samples_per_task=4,
                                        max_in_flight=8, trajectory_timeout_s=3.0)
    services("services.env_worker.main", WORKER_ID="load-env")
    services("services.rollout_worker.main", WORKER_ID="load-rollout", MAX_CONCURRENCY="8", HEARTBEAT_INTERVAL_S="0.5")
    services("services.controller.main", WORKER_ID="load-ctl", LEDGER_LEASE_MARGIN_S="0", RECONCILE_INTERVAL_S="0.5")
    with multiprocessing.get_context("spawn").Pool(2) as burners:
        burning = burners.map_async(burn_cpu, [60.0, 60.0])
        with engine.begin() as c:
            c.execute(insert(Run).values(id=run_id, name="loaded-eval", kind="eval", status="pending", config=config))
        status = wait_run_ended(engine, str(run_id), 240)
        burners.terminate()
        del burning
    with engine.connect() as c:
        summary, error, stalled = c.execute(text("SELECT summary, error, stall_reason FROM runs WHERE id = :r"),
                                            {"r": run_id}).one()
        stall_events = c.execute(text("SELECT count(*) FROM run_events WHERE run_id = :r AND kind = 'stalled'"),
                                 {"r": run_id}).scalar_one()
    engine.dispose()
    assert status == "completed", f"{status}: {error}; logs in {tmp_path}"
    assert summary["ledger"]["lost"] == 0 and summary["requeued"] == 0, summary["ledger"]
    assert summary["ledger"]["completed"] == 24 and stalled is None and stall_events == 0
