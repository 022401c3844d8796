"""A zombie result is never trained on (issue #12, part 1), with every service a real process.

A zombie is the result of an attempt whose lease expired (its worker was paused or partitioned) that arrives
after the expiry but before the controller's expiry pass marked the attempt lost. The store decides acceptance
under row locks; if the controller expired the attempt before storing the result, the store records it as a
`late_result` and the slot is retried as attempt 1. The trainer must train on attempt 1's result, never the
zombie's, whatever order the trainer and the store saw them in. Here the trainer is up before the controller
(so it sees the zombie while the ledger still says "dispatched"), then the controller's expiry runs, then the
store; the slot's retry completes the group.
"""

from __future__ import annotations

import threading
import time
import uuid
from pathlib import Path

import pytest
import redis
from fixtures.fake_rollouts import serve_rollout_tasks
from sqlalchemy import create_engine, text
from trainer_testlib import REPO, WeightServer

from services.controller import ledger
from shared.contracts.messages import EpisodeResult, RolloutTask, TrajectoryRecord, encode
from shared.contracts.run_config import RunConfig
from shared.contracts.streams import TRAJECTORIES
from tests.support.procs import ServiceGroup, wait_until
from tests.support.tiny_model import build_number_model


@pytest.fixture(scope="module")
def urls(isolated_urls):
    return isolated_urls


def _episode(t: RolloutTask, reward: float, version: int = 0) -> EpisodeResult:
    traj = TrajectoryRecord(uid=uuid.uuid4().hex, reward=reward, termination_reason="env_done",
                            prompt_ids=[62, 32, 12], response_ids=[7 + t.attempt], loss_mask=[1], logprobs=[-4.1],
                            versions=[version])
    return EpisodeResult(run_id=t.run_id, task_id=t.task_id, sample_idx=t.sample_idx, attempt=t.attempt,
                         status="completed", termination_reason="env_done", reward=reward, trajectories=[traj],
                         batch_idx=t.batch_idx, task=t.task, worker_id="fake")


def test_a_zombie_result_stored_as_late_is_never_trained_on(urls, tmp_path: Path):
    redis_url, database_url = urls
    engine = create_engine(database_url)
    model = build_number_model(tmp_path / "model")
    with engine.begin() as c:
        ds = c.execute(text("INSERT INTO datasets (id, name, split, source, num_rows, info) VALUES "
                            "(gen_random_uuid(), 'zombie', 'train', 'test', 2, '{}') RETURNING id")).scalar()
        for i in range(2):
            c.execute(text("INSERT INTO dataset_rows (dataset_id, idx, task_id, data, data_source) "
                           "VALUES (:d, :i, :t, '{}', 'test')"), {"d": ds, "i": i, "t": f"t{i}"})
    config = RunConfig(name="zombie", model=str(model), dataset="zombie", agent={"name": "math"},
                       env={"name": "math"}, samples_per_task=2, tasks_per_batch=2, total_steps=1, max_staleness=0,
                       max_attempts=3, algorithm={"adv_estimator": "grpo", "lr": 1e-3})
    run_id = str(uuid.uuid4())
    with engine.begin() as c:
        c.execute(text("INSERT INTO runs (id, name, kind, status, config, policy_version, summary) "
                       "VALUES (:id, 'zombie', 'train', 'running', CAST(:cfg AS jsonb), 0, '{}')"),
                  {"id": run_id, "cfg": config.model_dump_json()})
        # Attempt 0 of (t0, 0) was dispatched and its lease has expired; the controller has not noticed yet.
        c.execute(text("INSERT INTO rollout_tasks (run_id, task_id, sample_idx, attempt, status, batch_idx, epoch, "
                       "greedy, dispatch_version, lease_expires_at) VALUES "
                       "(:r, 't0', 0, 0, 'dispatched', 0, 0, false, 0, now() - interval '1 second')"),
                  {"r": run_id})
    zombie_task = RolloutTask(run_id=run_id, task_id="t0", sample_idx=0, attempt=0, task={}, batch_idx=0,
                              dispatched_at=time.time())
    client = redis.Redis.from_url(redis_url)
    client.xadd(TRAJECTORIES, encode(_episode(zombie_task, reward=1.0)))  # the zombie's result arrives

    ws = WeightServer(redis_url, database_url, tmp_path / "weights", keep_last=10).start()
    group = ServiceGroup(tmp_path, redis_url=redis_url, database_url=database_url, pythonpath=str(REPO))
    trainer = group.start("trainer", "services.trainer.main", worker_id="trainer-z", weight_server_url=ws.url,
                          weights_dir=ws.env["WEIGHTS_DIR"], state_dir=str(tmp_path / "trainer"), runs_poll_s="0.2")
    stop = threading.Event()
    worker = threading.Thread(target=serve_rollout_tasks, daemon=True, args=(
        redis_url, stop, lambda t: _episode(t, reward=float(t.sample_idx % 2))))
    try:
        wait_until(lambda: "training run" in group.log("trainer"), 150, "the trainer to open the run",
                   procs=[trainer])
        time.sleep(2.0)  # whatever the trainer reads of `trajectories`, it has read by now
        with engine.begin() as c:  # the controller's expiry pass (what its drive loop runs)
            assert ledger.expire_leases(c, run_id) == [("t0", 0, 0)]
        worker.start()
        group.start("controller", "services.controller.main", worker_id="ctl-z", poll_interval_s="0.2",
                    run_lease_s="2", reconcile_interval_s="0.3")

        def status() -> str:
            with engine.connect() as c:
                return c.execute(text("SELECT status FROM runs WHERE id = :r"), {"r": run_id}).scalar()
        wait_until(lambda: status() == "completed", 150, "the run to complete", procs=group.procs.values())
        with engine.connect() as c:
            late = c.execute(text("SELECT data FROM run_events WHERE run_id = :r AND kind = 'late_result'"),
                             {"r": run_id}).scalars().all()
            used = c.execute(text("SELECT task_id, sample_idx, attempt FROM train_samples WHERE run_id = :r "
                                  "AND status = 'used' ORDER BY 1, 2"), {"r": run_id}).all()
            stored = c.execute(text("SELECT attempt FROM episodes WHERE run_id = :r AND task_id = 't0' "
                                    "AND sample_idx = 0 AND status = 'completed'"), {"r": run_id}).scalars().all()
        assert late == [{"task_id": "t0", "sample_idx": 0, "attempt": 0, "result_status": "completed"}]
        assert stored == [1]  # the store kept the retry, not the zombie
        assert [tuple(r) for r in used] == [("t0", 0, 1), ("t0", 1, 0), ("t1", 0, 0), ("t1", 1, 0)]
    finally:
        stop.set()
        group.stop(60)
        ws.stop()
        engine.dispose()
