"""The trainer killed -9 at each point of a step (after training, after its checkpoint, after its commit, before
its publish) resumes with no sample lost or trained on twice, its versions announced in order, its trackers
complete and, for runs sharing one engine, the same weights as a twin never killed; a trainer taking over a dead
one's run gets the entries the dead one held."""

from __future__ import annotations

import json
import random
import uuid
from pathlib import Path

import pytest
import redis
import torch
from safetensors.torch import load_file
from sqlalchemy import create_engine, text
from trainer_service_testlib import (
    TASKS,
    N,
    assert_tracked_every_version,
    insert_run,
    pending,
    publish_batch,
    published_versions,
    reports,
    start_trainer,
    trained,
    wait_exit,
    wait_version,
)

from shared.contracts.messages import decode
from shared.contracts.streams import ACCEPTED_RESULTS, GROUP_TRAIN, WEIGHTS
from shared.platform import leases
from shared.weights.manifest import ADAPTER_CONFIG, ADAPTER_WEIGHTS, MANIFEST
from tests.support.procs import wait_until

pytestmark = pytest.mark.slow  # minutes of processes


@pytest.mark.timeout(600)  # three trainer starts, two of them killed: 70-85 s alone, 160 s beside the suite
@pytest.mark.parametrize("lora", [None, {"rank": 4, "target_modules": ["q_proj", "v_proj"]}], ids=["full", "lora"])
def test_trainer_killed_mid_step_resumes_with_nothing_lost_or_doubled(stack, redis_url, database_url, model_dir,
                                                                     tmp_path, lora):
    """Full weights, and a LoRA run (whose checkpoints hold the adapter and its optimizer state). The run is
    tracked in MLflow: each crash may come between a step's commit and its tracker call, and the restarted
    trainer re-sends what the tracker missed."""
    algorithm = {"adv_estimator": "grpo", "lr": 1e-3} | ({"lora": lora} if lora else {})
    from mlflow.tracking import MlflowClient

    mlflow_uri = f"sqlite:///{tmp_path}/mlflow.db"
    # the store set up before the crashes: MLflow's first-use migration of an SQLite file is not crash-safe
    MlflowClient(mlflow_uri).create_experiment("resume")
    run_id = insert_run(database_url, model_dir, max_staleness=5, algorithm=algorithm,
                         tracking={"mlflow": {"tracking_uri": mlflow_uri, "experiment": "resume"}})
    keys = set()
    for batch in range(4):
        keys |= publish_batch(redis_url, run_id, batch, 0)
    # Killed after training step 2 but before its checkpoint: step 2 is redone from checkpoint 1.
    proc = start_trainer(redis_url, database_url, stack, tmp_path, fault="trained:2")
    assert wait_exit(proc) == -9
    # Killed after checkpoint 3 but before recording it: the record is replayed from the checkpoint.
    proc = start_trainer(redis_url, database_url, stack, tmp_path, fault="checkpointed:3")
    assert wait_exit(proc) == -9
    proc = start_trainer(redis_url, database_url, stack, tmp_path)
    try:
        wait_version(database_url, run_id, 4, proc)
        every_group = {(f"b{b}-t{t}", b) for b in range(4) for t in range(TASKS)}

        def reported() -> set:
            return {(g.task_id, g.batch_idx) for m in reports(redis_url, run_id) for g in m.groups}

        # v4 is committed before it is announced, reported and its entries acknowledged: wait for all three (a
        # loaded box takes seconds), then check that nothing came twice. Step 3's report was lost in the crash:
        # every group reported means the restarted trainer re-sent its whole record.
        wait_until(lambda: published_versions(redis_url, run_id)[-1:] == [4] and pending(redis_url) == 0
                   and reported() == every_group, 120, "v4 announced, reported and acknowledged", procs=[proc])
        rows = trained(database_url, run_id)
        assert len(rows) == len(keys) == 4 * TASKS * N  # the primary key forbids a sample trained twice
        assert {(r.task_id, r.sample_idx) for r in rows} == keys
        assert sorted({r.version for r in rows}) == [1, 2, 3, 4]
        assert published_versions(redis_url, run_id) == [1, 2, 3, 4]
        assert pending(redis_url) == 0
        manifest = json.loads((Path(stack.env["WEIGHTS_DIR"]) / run_id / "v4" / MANIFEST).read_text())
        assert (set(manifest["files"]) == {ADAPTER_CONFIG, ADAPTER_WEIGHTS}) == bool(lora)  # a LoRA run: adapters
        assert_tracked_every_version(database_url, run_id, mlflow_uri, 4, proc)
    finally:
        proc.terminate()
        proc.wait(60)



def test_trainer_taking_over_a_dead_trainers_run_gets_its_pending_entries(stack, redis_url, database_url,
                                                                        model_dir, tmp_path):
    """The first trainer read a batch and died (entries pending under its name, its lease not yet expired).
    A second trainer, already running, opens the run when the lease expires and trains on those entries."""
    run_id = insert_run(database_url, model_dir)
    client = redis.Redis.from_url(redis_url)
    client.xgroup_create(ACCEPTED_RESULTS, GROUP_TRAIN, id="0", mkstream=True)
    keys = publish_batch(redis_url, run_id, 0, 0)
    client.xreadgroup(GROUP_TRAIN, "trainer-dead", {ACCEPTED_RESULTS: ">"})
    engine = create_engine(database_url)
    with engine.begin() as c:  # the dead trainer's lease: it stopped renewing
        assert leases.acquire(c, leases.TRAINER, "trainer-dead", [run_id], 600) == {run_id}
    proc = start_trainer(redis_url, database_url, stack, tmp_path, worker_id="trainer-next")
    try:
        def claimed_at_start() -> bool:  # its start-up claim ran while the run was still the dead trainer's
            consumers = client.xpending(ACCEPTED_RESULTS, GROUP_TRAIN)["consumers"]
            return [c["name"] for c in consumers] == [b"trainer-next"]
        wait_until(claimed_at_start, 90, "the second trainer's start-up claim", procs=(proc,))
        with engine.begin() as c:  # the dead trainer's lease expires
            c.execute(text("UPDATE trainer_leases SET expires_at = now() WHERE owner = 'trainer-dead'"))
        wait_version(database_url, run_id, 1, proc, timeout_s=60)
        rows = trained(database_url, run_id)
        assert {(r.task_id, r.sample_idx) for r in rows} == keys and {r.version for r in rows} == {1}
        wait_until(lambda: pending(redis_url) == 0, 90, "the entries to be acknowledged", procs=(proc,))
    finally:
        proc.terminate()
        proc.wait(60)



LORA = {"rank": 4, "target_modules": ["q_proj", "v_proj"]}


def _final_weights(redis_url: str, run_id: str, cache: Path) -> dict[str, torch.Tensor]:
    """The run's last announced version as a rollout worker loads it (deltas applied onto their snapshot)."""
    from shared.weights.fetch import materialize

    msgs = [decode(f) for _, f in redis.Redis.from_url(redis_url).xrange(WEIGHTS)]
    last = max((m for m in msgs if m.run_id == run_id), key=lambda m: m.version)
    folder = materialize(last, cache)
    return {k: v for f in sorted(folder.glob("*.safetensors")) for k, v in load_file(f).items()}


@pytest.mark.timeout(900)  # six trainer starts, two of them killed: 80 s alone, over 300 s beside the suite
def test_one_full_and_two_lora_runs_on_one_engine_resume_exactly_after_kills_mid_publish_and_mid_step(
        stack, redis_url, database_url, model_dir, tmp_path):
    """Lossless resume: a full-weight run and two LoRA runs sharing one engine, their trainer killed -9 after a
    step's commit and before its publish, then after a step's training and before its checkpoint. Each run ends
    with its consumed samples exact (none twice, none skipped), its versions announced strictly in order, and the
    same final weights as a twin trained on the same episodes by a trainer never killed: what the model, the
    optimizer's moments and the schedule hold was restored (reset moments give other weights)."""
    algorithms = [{"adv_estimator": "grpo", "lr": 1e-3}] + [{"adv_estimator": "grpo", "lr": 1e-3, "lora": LORA}] * 2

    def runs_with_episodes() -> tuple[list[str], list[set]]:
        run_ids = [insert_run(database_url, model_dir, max_staleness=5, algorithm=a) for a in algorithms]
        keys = []
        for i, run_id in enumerate(run_ids):
            got = set()
            for batch in range(4):
                random.seed(100 * i + batch)  # the same episodes for a run and its twin
                got |= publish_batch(redis_url, run_id, batch, 0)
            keys.append(got)
        return run_ids, keys

    twins, _ = runs_with_episodes()
    proc = start_trainer(redis_url, database_url, stack, tmp_path, worker_id="trainer-twins")
    try:
        for run_id in twins:
            wait_version(database_url, run_id, 4, proc, timeout_s=300)
    finally:
        proc.terminate()
        proc.wait(60)
    with create_engine(database_url).begin() as c:  # the twins are done: no trainer takes them again
        c.execute(text("UPDATE runs SET status = 'completed' WHERE id = ANY(:ids)"),
                  {"ids": [uuid.UUID(r) for r in twins]})

    runs, keys = runs_with_episodes()
    for fault in ("committed:2", "trained:3"):
        proc = start_trainer(redis_url, database_url, stack, tmp_path, fault=fault)
        assert wait_exit(proc, 300) == -9
    proc = start_trainer(redis_url, database_url, stack, tmp_path)
    try:
        for run_id in runs:
            wait_version(database_url, run_id, 4, proc, timeout_s=300)
            wait_until(lambda r=run_id: published_versions(redis_url, r)[-1:] == [4], 120, "v4 announced",
                       procs=[proc])
    finally:
        proc.terminate()
        proc.wait(60)
    announced = [decode(f) for _, f in redis.Redis.from_url(redis_url).xrange(WEIGHTS)]
    for run_id, twin, run_keys in zip(runs, twins, keys, strict=True):
        rows = trained(database_url, run_id)
        assert len(rows) == len(run_keys) and {(r.task_id, r.sample_idx) for r in rows} == run_keys
        order = [m.version for m in announced if m.run_id == run_id]
        assert order == [1, 2, 3, 4], order  # each version once, each after the one before
        mine, theirs = (_final_weights(redis_url, r, tmp_path / "cache" / r) for r in (run_id, twin))
        assert mine.keys() == theirs.keys() and mine
        for name in mine:
            torch.testing.assert_close(mine[name], theirs[name], rtol=1e-4, atol=1e-6, msg=name)
