"""The trainer as a process, for tests/e2e/trainer/ (whose conftest gives each module its own databases): runs
inserted as the controller stores them, accepted results published as the store publishes them, the trainer
started (with a fault injected), and what it committed, announced and reported read back."""

from __future__ import annotations

import random
import subprocess
import uuid
from pathlib import Path

import redis
from sqlalchemy import create_engine, text
from trainer_testlib import REPO, WeightServer

from shared.contracts.messages import (
    AcceptedResult,
    EpisodeResult,
    TrainerProgress,
    TrajectoryRecord,
    decode,
    encode,
)
from shared.contracts.run_config import RunConfig
from shared.contracts.streams import (
    ACCEPTED_RESULTS,
    GROUP_TRAIN,
    TRAINER_PROGRESS,
    WEIGHTS,
)
from shared.sdk.types import TerminationReason
from tests.support.procs import start_service, wait_until

TASKS, N = 2, 4  # groups per batch, samples per group


def insert_run(database_url: str, model_dir: Path, status: str = "running", **overrides) -> str:
    fields = dict(name="trainer-test", model=str(model_dir), dataset="digits", agent={"name": "math"},
                  env={"name": "math"}, samples_per_task=N, tasks_per_batch=TASKS, max_staleness=1,
                  algorithm={"adv_estimator": "grpo", "lr": 1e-3})
    config = RunConfig(**(fields | overrides))
    run_id = uuid.uuid4()
    with create_engine(database_url).begin() as c:
        c.execute(text("INSERT INTO runs (id, name, kind, status, config, policy_version, summary) "
                       "VALUES (:id, 'trainer-test', 'train', :status, CAST(:cfg AS jsonb), 0, '{}')"),
                  {"id": run_id, "cfg": config.model_dump_json(), "status": status})
    return str(run_id)


def result(run_id: str, task: str, sample: int, *, version: int = 0, attempt: int = 0, batch: int = 0,
            status: str = "completed", reason=TerminationReason.ENV_DONE, token: int | None = None) -> EpisodeResult:
    token = random.randrange(2, 64) if token is None else token
    reward = float(4 <= token <= 13)  # the digit tokens of the tiny tokenizer
    traj = TrajectoryRecord(uid=uuid.uuid4().hex, reward=reward, termination_reason=reason,
                            prompt_ids=[62, 32, 12], response_ids=[token], loss_mask=[1], logprobs=[-4.1],
                            versions=[version])
    return EpisodeResult(run_id=run_id, task_id=task, sample_idx=sample, attempt=attempt, status=status,
                         termination_reason=reason, reward=reward, trajectories=[traj], batch_idx=batch)


def accept(client: redis.Redis, result: EpisodeResult) -> None:
    """What the store publishes once it accepted `result`."""
    client.xadd(ACCEPTED_RESULTS, encode(AcceptedResult.stored(result)))


def publish_batch(redis_url: str, run_id: str, batch: int, version: int) -> set[tuple[str, int]]:
    client = redis.Redis.from_url(redis_url)
    keys = set()
    for t in range(TASKS):
        for s in range(N):
            # each group holds a right answer (a digit, 4..13) and a wrong one, the rest drawn: GRPO has a signal
            # in every group, so each version moves the weights (all-equal groups leave an adapter at its init,
            # and two LoRA runs' adapters then equal: about 1 CI run in 250 met that)
            token = {0: 5, 1: 40}.get(s)
            accept(client, result(run_id, f"b{batch}-t{t}", s, version=version, batch=batch, token=token))
            keys.add((f"b{batch}-t{t}", s))
    return keys


def start_trainer(redis_url, database_url, ws: WeightServer, tmp_path: Path, fault: str | None = None,
                   launcher: tuple[str, ...] = (), worker_id: str = "trainer-t", **env: str):
    # A fault is injected by the test's own wrapper of the service (trainer_with_fault.py), which kills it there.
    target = str(REPO / "tests/e2e/trainer/trainer_with_fault.py") if fault else "services.trainer.main"
    return start_service(target, launcher=launcher, log=tmp_path / f"trainer-{fault or 'clean'}.log",
                         redis_url=redis_url, database_url=database_url, weight_server_url=ws.url,
                         weights_dir=ws.env["WEIGHTS_DIR"], state_dir=str(tmp_path / "trainer"), worker_id=worker_id,
                         runs_poll_s="0.2", pythonpath=str(REPO), fault_point=fault,
                         master_port=None, master_addr=None, rank=None, world_size=None, **env)


def wait_version(database_url: str, run_id: str, version: int, proc, timeout_s: float = 120) -> None:
    """Until the trainer committed `version` (its own record: these tests run no controller)."""
    engine = create_engine(database_url)

    def committed() -> bool:
        with engine.connect() as c:
            return c.execute(text("SELECT coalesce(max(version), 0) FROM train_samples WHERE run_id = :id "
                                  "AND status = 'used'"), {"id": run_id}).scalar() >= version

    wait_until(committed, timeout_s, f"the trainer to commit version {version}", procs=[proc], interval_s=0.3)


def wait_exit(proc: subprocess.Popen, timeout_s: float = 120) -> int:
    try:
        return proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        raise


def trained(database_url: str, run_id: str) -> list[tuple]:
    with create_engine(database_url).connect() as c:
        return c.execute(text("SELECT task_id, sample_idx, attempt, version, status FROM train_samples "
                              "WHERE run_id = :id ORDER BY version, task_id, sample_idx"), {"id": run_id}).all()


def published_versions(redis_url: str, run_id: str) -> list[int]:
    msgs = [decode(f) for _, f in redis.Redis.from_url(redis_url).xrange(WEIGHTS)]
    return sorted({m.version for m in msgs if m.run_id == run_id})


def pending(redis_url: str) -> int:
    return redis.Redis.from_url(redis_url).xpending(ACCEPTED_RESULTS, GROUP_TRAIN)["pending"]


def reports(redis_url: str, run_id: str) -> list[TrainerProgress]:
    msgs = [decode(f) for _, f in redis.Redis.from_url(redis_url).xrange(TRAINER_PROGRESS)]
    return [m for m in msgs if m.run_id == run_id]



def assert_tracked_every_version(database_url: str, run_id: str, mlflow_uri: str, last: int, proc) -> None:
    """Every committed version 1..last reached MLflow with its metrics (none lost to a crash), as its record in
    `tracker_progress` says."""
    from mlflow.tracking import MlflowClient

    engine = create_engine(database_url)

    def tracked() -> int:
        with engine.connect() as c:
            return c.execute(text("SELECT coalesce(max(version), 0) FROM tracker_progress WHERE run_id = :id AND "
                                  "tracker = 'mlflow'"), {"id": run_id}).scalar()

    wait_until(lambda: tracked() >= last, 60, f"MLflow to hold version {last}", procs=[proc])
    with engine.connect() as c:
        committed = {r.step: r.value for r in c.execute(text(
            "SELECT step, value FROM metrics WHERE run_id = :id AND name = 'reward_mean'"), {"id": run_id})}
    client = MlflowClient(mlflow_uri)
    (run,) = client.search_runs([client.get_experiment_by_name("resume").experiment_id],
                                f"tags.`flywheel.run_id` = '{run_id}'")
    history = {m.step: m.value for m in client.get_metric_history(run.info.run_id, "reward_mean")}
    assert sorted(history) == sorted(committed) == list(range(1, last + 1))
    assert history == committed
