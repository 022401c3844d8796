"""The trainer as a real process: consumes what the store accepted (`results.accepted`), trains with verl,
checkpoints, records, reports to the controller and publishes through a real weight server; killed mid-step it
resumes with no sample lost or trained on twice. With a real controller in front of it, it trains only on
results the store accepted: a zombie result (its attempt's lease expired) is never trained on."""

from __future__ import annotations

import json
import random
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import pytest
import redis
import torch
from fixtures.fake_rollouts import serve_rollout_tasks
from safetensors.torch import load_file
from sqlalchemy import create_engine, text
from trainer_testlib import REPO, WeightServer

from infra.local.ports import free_port
from infra.local.servers import scratch_database
from shared.contracts.messages import (
    AcceptedResult,
    EpisodeResult,
    RolloutTask,
    TrainerProgress,
    TrajectoryRecord,
    decode,
    encode,
)
from shared.contracts.run_config import RunConfig
from shared.contracts.streams import (
    ACCEPTED_RESULTS,
    GROUP_TRAIN,
    ROLLOUT_TASKS,
    TRAINER_PROGRESS,
    TRAJECTORIES,
    WEIGHTS,
    heartbeat_key,
)
from shared.platform import leases
from shared.sdk.types import TerminationReason
from shared.weights.manifest import ADAPTER_CONFIG, ADAPTER_WEIGHTS, MANIFEST
from tests.support.procs import start_service, wait_until
from tests.support.tiny_model import build_number_model

TASKS, N = 2, 4  # groups per batch, samples per group


@pytest.fixture(scope="module")
def database_url(pg_admin_url):
    """This module's own database: runs left `running` by earlier modules would be leased by the trainer."""
    with scratch_database(pg_admin_url, migrate=True) as url:
        yield url


@pytest.fixture(scope="module")
def redis_url(redis_url):
    """The session's Redis database, flushed: no stream groups or trainer leases from earlier modules."""
    redis.Redis.from_url(redis_url).flushdb()
    return redis_url


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return build_number_model(tmp_path_factory.mktemp("model") / "digit")


@pytest.fixture
def stack(redis_url, database_url, tmp_path):
    client = redis.Redis.from_url(redis_url)
    client.delete(TRAJECTORIES, WEIGHTS, ROLLOUT_TASKS, ACCEPTED_RESULTS, TRAINER_PROGRESS)
    ws = WeightServer(redis_url, database_url, tmp_path / "weights", keep_last=10).start()
    yield ws
    ws.stop()


@pytest.fixture(autouse=True)
def _stop_runs(database_url):
    yield  # the database lives for the session: leave no run for the next test's trainer
    with create_engine(database_url).begin() as c:
        c.execute(text("UPDATE runs SET status = 'stopped' WHERE status = 'running'"))


def _insert_run(database_url: str, model_dir: Path, status: str = "running", **overrides) -> str:
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


def _result(run_id: str, task: str, sample: int, *, version: int = 0, attempt: int = 0, batch: int = 0,
            status: str = "completed", reason=TerminationReason.ENV_DONE, token: int | None = None) -> EpisodeResult:
    token = random.randrange(2, 64) if token is None else token
    reward = float(4 <= token <= 13)  # the digit tokens of the tiny tokenizer
    traj = TrajectoryRecord(uid=uuid.uuid4().hex, reward=reward, termination_reason=reason,
                            prompt_ids=[62, 32, 12], response_ids=[token], loss_mask=[1], logprobs=[-4.1],
                            versions=[version])
    return EpisodeResult(run_id=run_id, task_id=task, sample_idx=sample, attempt=attempt, status=status,
                         termination_reason=reason, reward=reward, trajectories=[traj], batch_idx=batch)


def _accept(client: redis.Redis, result: EpisodeResult) -> None:
    """What the store publishes once it accepted `result`."""
    client.xadd(ACCEPTED_RESULTS, encode(AcceptedResult.stored(result)))


def _publish_batch(redis_url: str, run_id: str, batch: int, version: int) -> set[tuple[str, int]]:
    client = redis.Redis.from_url(redis_url)
    keys = set()
    for t in range(TASKS):
        for s in range(N):
            # each group holds a right answer (a digit, 4..13) and a wrong one, the rest drawn: GRPO has a signal
            # in every group, so each version moves the weights (all-equal groups leave an adapter at its init,
            # and two LoRA runs' adapters then equal: about 1 CI run in 250 met that)
            token = {0: 5, 1: 40}.get(s)
            _accept(client, _result(run_id, f"b{batch}-t{t}", s, version=version, batch=batch, token=token))
            keys.add((f"b{batch}-t{t}", s))
    return keys


def _start_trainer(redis_url, database_url, ws: WeightServer, tmp_path: Path, fault: str | None = None,
                   launcher: tuple[str, ...] = (), worker_id: str = "trainer-t", **env: str):
    # A fault is injected by the test's own wrapper of the service (trainer_with_fault.py), which kills it there.
    target = str(Path(__file__).with_name("trainer_with_fault.py")) if fault else "services.trainer.main"
    return start_service(target, launcher=launcher, log=tmp_path / f"trainer-{fault or 'clean'}.log",
                         redis_url=redis_url, database_url=database_url, weight_server_url=ws.url,
                         weights_dir=ws.env["WEIGHTS_DIR"], state_dir=str(tmp_path / "trainer"), worker_id=worker_id,
                         runs_poll_s="0.2", pythonpath=str(REPO), fault_point=fault,
                         master_port=None, master_addr=None, rank=None, world_size=None, **env)


def _wait_version(database_url: str, run_id: str, version: int, proc, timeout_s: float = 120) -> None:
    """Until the trainer committed `version` (its own record: these tests run no controller)."""
    engine = create_engine(database_url)

    def committed() -> bool:
        with engine.connect() as c:
            return c.execute(text("SELECT coalesce(max(version), 0) FROM train_samples WHERE run_id = :id "
                                  "AND status = 'used'"), {"id": run_id}).scalar() >= version

    wait_until(committed, timeout_s, f"the trainer to commit version {version}", procs=[proc], interval_s=0.3)


def _wait_exit(proc: subprocess.Popen, timeout_s: float = 120) -> int:
    try:
        return proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        raise


def _trained(database_url: str, run_id: str) -> list[tuple]:
    with create_engine(database_url).connect() as c:
        return c.execute(text("SELECT task_id, sample_idx, attempt, version, status FROM train_samples "
                              "WHERE run_id = :id ORDER BY version, task_id, sample_idx"), {"id": run_id}).all()


def _published_versions(redis_url: str, run_id: str) -> list[int]:
    msgs = [decode(f) for _, f in redis.Redis.from_url(redis_url).xrange(WEIGHTS)]
    return sorted({m.version for m in msgs if m.run_id == run_id})


def _pending(redis_url: str) -> int:
    return redis.Redis.from_url(redis_url).xpending(ACCEPTED_RESULTS, GROUP_TRAIN)["pending"]


def _reports(redis_url: str, run_id: str) -> list[TrainerProgress]:
    msgs = [decode(f) for _, f in redis.Redis.from_url(redis_url).xrange(TRAINER_PROGRESS)]
    return [m for m in msgs if m.run_id == run_id]


def test_trainer_trains_whole_groups_reports_and_publishes(stack, redis_url, database_url, model_dir, tmp_path):
    run_id = _insert_run(database_url, model_dir)
    client = redis.Redis.from_url(redis_url)
    keys = set()
    _accept(client, _result(run_id, "b0-t0", 0, attempt=1))
    keys.add(("b0-t0", 0))
    _accept(client, _result(run_id, "b0-t0", 0, attempt=1))  # published again (a re-delivery to the store)
    for s in range(1, N):
        _accept(client, _result(run_id, "b0-t0", s))
        keys.add(("b0-t0", s))
    for s in range(N):
        _accept(client, _result(run_id, "b0-t1", s))
        keys.add(("b0-t1", s))
    keys |= _publish_batch(redis_url, run_id, 1, 0)
    # An incomplete group (3 of 4 samples) is never trained on.
    for s in range(N - 1):
        _accept(client, _result(run_id, "b2-partial", s, batch=2))

    # A run whose model cannot be loaded is reported on trainer.progress, written nowhere, and stops no other run.
    unloadable = _insert_run(database_url, model_dir.parent / "no-such-model")

    proc = _start_trainer(redis_url, database_url, stack, tmp_path)
    try:
        _wait_version(database_url, run_id, 2, proc)
        time.sleep(1.0)
        errors = [m.error for m in _reports(redis_url, unloadable)]
        assert len(errors) == 1 and "no-such-model" in errors[0], errors
        with create_engine(database_url).connect() as c:
            assert c.execute(text("SELECT count(*) FROM run_events WHERE run_id = :id"),
                             {"id": unloadable}).scalar() == 0  # the controller records it, not the trainer
        rows = _trained(database_url, run_id)
        assert {(r.task_id, r.sample_idx) for r in rows} == keys
        assert all(r.status == "used" for r in rows)
        by_version = {v: {r.task_id for r in rows if r.version == v} for v in (1, 2)}
        assert all(len(tasks) == TASKS for tasks in by_version.values())  # whole groups, tasks_per_batch each
        assert _published_versions(redis_url, run_id) == [1, 2]
        # the controller hears of each version and the groups its step used, from the trainer's reports only
        reports = _reports(redis_url, run_id)
        assert max(m.version for m in reports) == 2
        used = {(g.task_id, g.batch_idx) for m in reports for g in m.groups if g.status == "used"}
        assert used == {(f"b{b}-t{t}", b) for b in (0, 1) for t in range(TASKS)}
        with create_engine(database_url).connect() as c:
            names = set(c.execute(text("SELECT DISTINCT name FROM metrics WHERE run_id = :id"), {"id": run_id})
                        .scalars())
            ckpts = c.execute(text("SELECT version FROM checkpoints WHERE run_id = :id ORDER BY 1"),
                              {"id": run_id}).scalars().all()
            mismatch = {(r.name, r.step): r.value for r in c.execute(text(
                "SELECT name, step, value FROM metrics WHERE run_id = :id AND (name LIKE 'logprob_diff%' "
                "OR name = 'is_truncated_fraction')"), {"id": run_id})}
        assert {"reward_mean", "reward_std", "pass_rate", "entropy", "grad_norm", "clip_fraction",
                "tokens_per_s", "kl_behaviour", "groups_without_signal"} <= names
        # verl's rollout-correction and async sets, under verl's names (no rollout worker stamped these
        # results, so no rollout idle ratio is made up)
        assert {"rollout_corr/kl", "rollout_corr/chi2_seq", "rollout_corr/rollout_is_eff_sample_size",
                "fully_async/trainer/idle_ratio", "fully_async/partial/partial_ratio"} <= names
        assert "fully_async/rollouter/idle_ratio" not in names
        # Training-inference mismatch, as the real trainer records it: step 1 starts from version 0, which
        # generated every token at hand (one a sample): its batch, and the waiting samples it probes (batch 1
        # and the incomplete group); step 2 starts from version 1, which generated none of them, so it has no
        # logprob_diff rows (never a made-up 0). IS truncation: every step.
        assert mismatch[("logprob_diff_tokens", 1)] == 2 * TASKS * N + (N - 1)
        assert 0 < mismatch[("logprob_diff_mean", 1)] <= mismatch[("logprob_diff_max", 1)]
        assert not any(name.startswith("logprob_diff") and step == 2 for name, step in mismatch)
        assert {("is_truncated_fraction", 1), ("is_truncated_fraction", 2)} <= set(mismatch)
        assert ckpts == [1, 2]
        assert _pending(redis_url) == N - 1  # only the incomplete group is still held
        with create_engine(database_url).begin() as c:  # the run stops: what it held is released
            c.execute(text("UPDATE runs SET status = 'stopping' WHERE id = :id"), {"id": run_id})
        deadline = time.monotonic() + 10
        while _pending(redis_url) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert _pending(redis_url) == 0
    finally:
        proc.terminate()
        proc.wait(60)


def test_lora_runs_of_one_kind_share_one_engine_in_the_trainer(stack, redis_url, database_url, model_dir, tmp_path):
    """Two LoRA runs over one base and a full-weight run in one trainer process: two engines (the LoRA runs share
    theirs, services/trainer/lora_shared_engine.py), and each run trains and publishes its own versions."""
    algorithm = {"adv_estimator": "grpo", "lr": 1e-3, "lora": {"rank": 4, "target_modules": ["q_proj", "v_proj"]}}
    runs = [_insert_run(database_url, model_dir, algorithm=algorithm) for _ in range(2)]
    runs.append(_insert_run(database_url, model_dir))
    for run_id in runs:
        for batch in range(2):
            _publish_batch(redis_url, run_id, batch, 0)
    proc = _start_trainer(redis_url, database_url, stack, tmp_path)
    try:
        for run_id in runs:
            _wait_version(database_url, run_id, 2, proc)
            wait_until(lambda r=run_id: _published_versions(redis_url, r) == [1, 2], 60, "v2 announced",
                       procs=[proc])
        client = redis.Redis.from_url(redis_url)
        beat = lambda: json.loads(client.get(heartbeat_key("trainer", "trainer-t")) or "{}")  # noqa: E731
        wait_until(lambda: set(beat().get("runs", ())) == set(runs), 30, "a heartbeat naming the three runs")
        assert beat()["model_copies"] == 2 and sorted(beat()["trains"]) == sorted(runs), beat()
        adapters = [load_file(Path(stack.env["WEIGHTS_DIR"]) / r / "v2" / ADAPTER_WEIGHTS) for r in runs[:2]]
        assert adapters[0].keys() == adapters[1].keys()
        assert any(not torch.equal(adapters[0][k], adapters[1][k]) for k in adapters[0])  # each its own adapter
    finally:
        proc.terminate()
        proc.wait(60)


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
    run_id = _insert_run(database_url, model_dir, max_staleness=5, algorithm=algorithm,
                         tracking={"mlflow": {"tracking_uri": mlflow_uri, "experiment": "resume"}})
    keys = set()
    for batch in range(4):
        keys |= _publish_batch(redis_url, run_id, batch, 0)
    # Killed after training step 2 but before its checkpoint: step 2 is redone from checkpoint 1.
    proc = _start_trainer(redis_url, database_url, stack, tmp_path, fault="trained:2")
    assert _wait_exit(proc) == -9
    # Killed after checkpoint 3 but before recording it: the record is replayed from the checkpoint.
    proc = _start_trainer(redis_url, database_url, stack, tmp_path, fault="checkpointed:3")
    assert _wait_exit(proc) == -9
    proc = _start_trainer(redis_url, database_url, stack, tmp_path)
    try:
        _wait_version(database_url, run_id, 4, proc)
        time.sleep(1.0)
        rows = _trained(database_url, run_id)
        assert len(rows) == len(keys) == 4 * TASKS * N  # the primary key forbids a sample trained twice
        assert {(r.task_id, r.sample_idx) for r in rows} == keys
        assert sorted({r.version for r in rows}) == [1, 2, 3, 4]
        assert _published_versions(redis_url, run_id) == [1, 2, 3, 4]
        assert _pending(redis_url) == 0
        # step 3's report was lost in the crash; the restarted trainer re-sent its whole record
        reported = {(g.task_id, g.batch_idx) for m in _reports(redis_url, run_id) for g in m.groups}
        assert reported == {(f"b{b}-t{t}", b) for b in range(4) for t in range(TASKS)}
        manifest = json.loads((Path(stack.env["WEIGHTS_DIR"]) / run_id / "v4" / MANIFEST).read_text())
        assert (set(manifest["files"]) == {ADAPTER_CONFIG, ADAPTER_WEIGHTS}) == bool(lora)  # a LoRA run: adapters
        _assert_tracked_every_version(database_url, run_id, mlflow_uri, 4, proc)
    finally:
        proc.terminate()
        proc.wait(60)


def _assert_tracked_every_version(database_url: str, run_id: str, mlflow_uri: str, last: int, proc) -> None:
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


def _start_controller(redis_url: str, database_url: str, tmp_path: Path) -> subprocess.Popen:
    return start_service("services.controller.main", log=tmp_path / "controller.log", redis_url=redis_url,
                         database_url=database_url, worker_id="ctl-t", poll_interval_s="0.2", run_lease_s="2",
                         reconcile_interval_s="0.3", store_claim_idle_ms="1000")


def _episode(t: RolloutTask, reward: float | None) -> EpisodeResult:
    """The rollout worker's answer to `t`: one trajectory with `reward`, or None: the attempt failed (infra)."""
    if reward is None:
        return EpisodeResult(run_id=t.run_id, task_id=t.task_id, sample_idx=t.sample_idx, attempt=t.attempt,
                             status="failed", termination_reason="infra_error", error="env session lost",
                             batch_idx=t.batch_idx, task=t.task)
    traj = TrajectoryRecord(uid=uuid.uuid4().hex, reward=reward, termination_reason="env_done",
                            prompt_ids=[62, 32, 12], response_ids=[random.randrange(2, 64)], loss_mask=[1],
                            logprobs=[-4.1], versions=[t.dispatch_version])
    return EpisodeResult(run_id=t.run_id, task_id=t.task_id, sample_idx=t.sample_idx, attempt=t.attempt,
                         status="completed", termination_reason="env_done", reward=reward, trajectories=[traj],
                         batch_idx=t.batch_idx, task=t.task)


def test_dropped_and_incomplete_groups_are_refilled_until_total_steps(stack, redis_url, database_url, model_dir,
                                                                     tmp_path):
    """Controller + trainer + a fake rollout worker: with dynamic sampling, task t0's groups (all rewards equal)
    are filtered every epoch, and one slot of the first batch fails for good (max_attempts=1), so its group can
    never complete. The trainer drops and records both kinds at once, the controller dispatches replacements
    (further epochs), and the run reaches total_steps and completes."""
    dataset = f"refill-{uuid.uuid4().hex[:6]}"
    engine = create_engine(database_url)
    with engine.begin() as c:
        ds = c.execute(text("INSERT INTO datasets (id, name, split, source, num_rows, info) VALUES "
                            "(gen_random_uuid(), :n, 'train', 'test', 4, '{}') RETURNING id"), {"n": dataset}).scalar()
        for i in range(4):
            c.execute(text("INSERT INTO dataset_rows (dataset_id, idx, task_id, data, data_source) "
                           "VALUES (:d, :i, :t, '{}', 'test')"), {"d": ds, "i": i, "t": f"t{i}"})
    run_id = _insert_run(database_url, model_dir, status="pending", dataset=dataset, samples_per_task=2,
                         total_steps=3, max_staleness=0, stale_policy="drop", max_attempts=1,
                         algorithm={"adv_estimator": "grpo", "lr": 1e-3, "dynamic_sampling": True})
    doomed: list[str] = []  # the first task dispatched: its slot 1 in epoch 0 fails for good

    def answer(t: RolloutTask) -> float | None:
        if not doomed:
            doomed.append(t.task_id)
        if t.task_id == doomed[0] and t.sample_idx == 1:
            return None
        return 1.0 if t.task_id == "t0" else float(t.sample_idx % 2)

    stop = threading.Event()
    worker = threading.Thread(target=serve_rollout_tasks, args=(redis_url, stop, lambda t: _episode(t, answer(t))),
                              daemon=True)
    worker.start()
    ctl = _start_controller(redis_url, database_url, tmp_path)
    proc = _start_trainer(redis_url, database_url, stack, tmp_path)
    try:
        def status() -> str:
            with engine.connect() as c:
                return c.execute(text("SELECT status FROM runs WHERE id = :id"), {"id": run_id}).scalar()
        wait_until(lambda: status() == "completed", 120, "the run to complete", procs=(ctl, proc))
        rows = _trained(database_url, run_id)
        used = [r for r in rows if r.status == "used"]
        assert sorted({r.version for r in used}) == [1, 2, 3] and len(used) == 3 * TASKS * 2
        assert not any(r.task_id == "t0" for r in used)  # never trained on a group without signal
        assert any(r.task_id == "t0" and r.status == "filtered" for r in rows)
        assert [(r.task_id, r.sample_idx) for r in rows if r.status == "incomplete"] == [(doomed[0], 0)]
        assert max(r.sample_idx for r in used) >= 2  # replacements came from a further epoch
        wait_until(lambda: _pending(redis_url) == 0, 90, "the trainer to release what it held", procs=(proc,))
    finally:
        stop.set()
        for p in (ctl, proc):
            p.terminate()
            p.wait(60)
        worker.join(10)


def test_trainer_taking_over_a_dead_trainers_run_gets_its_pending_entries(stack, redis_url, database_url,
                                                                        model_dir, tmp_path):
    """The first trainer read a batch and died (entries pending under its name, its lease not yet expired).
    A second trainer, already running, opens the run when the lease expires and trains on those entries."""
    run_id = _insert_run(database_url, model_dir)
    client = redis.Redis.from_url(redis_url)
    client.xgroup_create(ACCEPTED_RESULTS, GROUP_TRAIN, id="0", mkstream=True)
    keys = _publish_batch(redis_url, run_id, 0, 0)
    client.xreadgroup(GROUP_TRAIN, "trainer-dead", {ACCEPTED_RESULTS: ">"})
    engine = create_engine(database_url)
    with engine.begin() as c:  # the dead trainer's lease: it stopped renewing
        assert leases.acquire(c, leases.TRAINER, "trainer-dead", [run_id], 600) == {run_id}
    proc = _start_trainer(redis_url, database_url, stack, tmp_path, worker_id="trainer-next")
    try:
        def claimed_at_start() -> bool:  # its start-up claim ran while the run was still the dead trainer's
            consumers = client.xpending(ACCEPTED_RESULTS, GROUP_TRAIN)["consumers"]
            return [c["name"] for c in consumers] == [b"trainer-next"]
        wait_until(claimed_at_start, 90, "the second trainer's start-up claim", procs=(proc,))
        with engine.begin() as c:  # the dead trainer's lease expires
            c.execute(text("UPDATE trainer_leases SET expires_at = now() WHERE owner = 'trainer-dead'"))
        _wait_version(database_url, run_id, 1, proc, timeout_s=60)
        rows = _trained(database_url, run_id)
        assert {(r.task_id, r.sample_idx) for r in rows} == keys and {r.version for r in rows} == {1}
        wait_until(lambda: _pending(redis_url) == 0, 90, "the entries to be acknowledged", procs=(proc,))
    finally:
        proc.terminate()
        proc.wait(60)


@pytest.mark.slow
@pytest.mark.parametrize("lora", [None, {"rank": 4, "target_modules": ["q_proj", "v_proj"]}], ids=["full", "lora"])
def test_trainer_service_under_torchrun_two_ranks(stack, redis_url, database_url, model_dir, tmp_path, lora):
    """Two ranks of FSDP2, full weights and a LoRA run: a LoRA version is the whole adapter (every tensor at
    its full shape, not rank 0's shard), with the base frozen."""
    port = free_port()
    algorithm = {"adv_estimator": "grpo", "lr": 1e-3} | ({"lora": lora} if lora else {})
    run_id = _insert_run(database_url, model_dir, algorithm=algorithm)
    keys = _publish_batch(redis_url, run_id, 0, 0) | _publish_batch(redis_url, run_id, 1, 0)
    proc = _start_trainer(redis_url, database_url, stack, tmp_path, launcher=(
        "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={port}"))
    try:
        _wait_version(database_url, run_id, 2, proc)
        rows = _trained(database_url, run_id)
        assert {(r.task_id, r.sample_idx) for r in rows} == keys
        # a step is recorded before it is published: wait for the announcement
        wait_until(lambda: _published_versions(redis_url, run_id) == [1, 2], 60, "v2 announced", procs=[proc])
        if lora:
            from safetensors.torch import load_file

            hidden = json.loads((model_dir / "config.json").read_text())["hidden_size"]
            adapter = load_file(Path(stack.env["WEIGHTS_DIR"]) / run_id / "v2" / ADAPTER_WEIGHTS)
            a = {n: t.shape for n, t in adapter.items() if "lora_A" in n}
            assert a and all(shape == (lora["rank"], hidden) for shape in a.values()), a
            assert len(adapter) == 2 * len(a) and all("base_layer" not in n for n in adapter)
    finally:
        proc.terminate()  # torchrun passes SIGTERM on; rank 0 stops the follower, every process exits
        proc.wait(90)


def test_trainer_logs_each_version_to_its_trackers_and_a_dead_one_only_counts(stack, redis_url, database_url,
                                                                               model_dir, tmp_path):
    """A run tracked in W&B (offline), TensorBoard and an MLflow server that is down: every version reaches W&B
    and TensorBoard with the version as the step, then the summary when the run ends; MLflow's failure is the
    run's tracker warning (heartbeat) and the metric tracker_errors, and training goes on."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    down = f"http://127.0.0.1:{free_port()}"
    run_id = _insert_run(database_url, model_dir, tracking={
        "wandb": {"project": "flywheel-test", "mode": "offline"}, "tensorboard": {"dir": str(tmp_path / "tb")},
        "mlflow": {"tracking_uri": down}})
    for batch in range(2):
        _publish_batch(redis_url, run_id, batch, 0)
    proc = _start_trainer(redis_url, database_url, stack, tmp_path, data_dir=str(tmp_path / "data"))
    try:
        _wait_version(database_url, run_id, 2, proc)
        client = redis.Redis.from_url(redis_url)
        beat = lambda: json.loads(client.get(heartbeat_key("trainer", "trainer-t")) or "{}")  # noqa: E731
        wait_until(lambda: run_id in beat().get("tracker_warnings", {}), 60, "the tracker warning", procs=[proc])
        assert down in beat()["tracker_warnings"][run_id] and "mlflow" in beat()["tracker_warnings"][run_id]
        _publish_batch(redis_url, run_id, 2, 2)  # trained on after the failure: its metrics count it
        _wait_version(database_url, run_id, 3, proc)
        with create_engine(database_url).begin() as c:
            metrics = {(r.name, r.step): r.value for r in c.execute(text(
                "SELECT name, step, value FROM metrics WHERE run_id = :id"), {"id": run_id})}
            c.execute(text("UPDATE runs SET status = 'stopped' WHERE id = :id"), {"id": run_id})  # the run ends
        assert metrics[("tracker_errors", 3)] == 1.0 and metrics[("trajectories_per_s", 3)] > 0
        assert metrics[("rollout_tokens_per_s", 3)] > 0  # one generated token a result
        assert metrics[("samples_ended_env_done", 3)] == TASKS * N  # how the batch's episodes ended
        (folder,) = (tmp_path / "tb").iterdir()

        def summarised() -> bool:
            acc = EventAccumulator(str(folder))
            acc.Reload()
            return "summary/text_summary" in acc.Tags()["tensors"]

        wait_until(summarised, 60, "the TensorBoard summary", procs=[proc])
        acc = EventAccumulator(str(folder))
        acc.Reload()
        assert [(e.step, e.value) for e in acc.Scalars("reward_mean")] == [
            (v, metrics[("reward_mean", v)]) for v in (1, 2, 3)]
        summary = acc.Tensors("summary/text_summary")[0].tensor_proto.string_val[0].decode()
        assert '"status": "stopped"' in summary and '"policy_version": 3' in summary
        (wandb_file,) = (tmp_path / "data" / "wandb").glob(f"offline-run-*/run-{run_id}.wandb")
        wandb = [str(Path(sys.executable).with_name("wandb")), "leet", "inspect", "--json"]
        wait_until(lambda: json.loads(subprocess.run([*wandb, "--summary", str(wandb_file)], capture_output=True,
                                                     text=True).stdout or "{}").get("state") == "finished",
                   60, "the W&B run finished", procs=[proc])
        records = [json.loads(line) for line in subprocess.run([*wandb, str(wandb_file)], capture_output=True,
                                                               text=True, check=True).stdout.splitlines()]
        history = {r["history"]["step"]["num"]: r["history"]["item"] for r in records if r["type"] == "history"}
        assert sorted(history) == [1, 2, 3] and history[3]["tracker_errors"] == 1
        assert all(history[v]["reward_mean"] == metrics[("reward_mean", v)] for v in (1, 2, 3))
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


def test_one_full_and_two_lora_runs_on_one_engine_resume_exactly_after_kills_mid_publish_and_mid_step(
        stack, redis_url, database_url, model_dir, tmp_path):
    """Lossless resume: a full-weight run and two LoRA runs sharing one engine, their trainer killed -9 after a
    step's commit and before its publish, then after a step's training and before its checkpoint. Each run ends
    with its consumed samples exact (none twice, none skipped), its versions announced strictly in order, and the
    same final weights as a twin trained on the same episodes by a trainer never killed: what the model, the
    optimizer's moments and the schedule hold was restored (reset moments give other weights)."""
    algorithms = [{"adv_estimator": "grpo", "lr": 1e-3}] + [{"adv_estimator": "grpo", "lr": 1e-3, "lora": LORA}] * 2

    def runs_with_episodes() -> tuple[list[str], list[set]]:
        run_ids = [_insert_run(database_url, model_dir, max_staleness=5, algorithm=a) for a in algorithms]
        keys = []
        for i, run_id in enumerate(run_ids):
            got = set()
            for batch in range(4):
                random.seed(100 * i + batch)  # the same episodes for a run and its twin
                got |= _publish_batch(redis_url, run_id, batch, 0)
            keys.append(got)
        return run_ids, keys

    twins, _ = runs_with_episodes()
    proc = _start_trainer(redis_url, database_url, stack, tmp_path, worker_id="trainer-twins")
    try:
        for run_id in twins:
            _wait_version(database_url, run_id, 4, proc, timeout_s=300)
    finally:
        proc.terminate()
        proc.wait(60)
    with create_engine(database_url).begin() as c:  # the twins are done: no trainer takes them again
        c.execute(text("UPDATE runs SET status = 'completed' WHERE id = ANY(:ids)"),
                  {"ids": [uuid.UUID(r) for r in twins]})

    runs, keys = runs_with_episodes()
    for fault in ("committed:2", "trained:3"):
        proc = _start_trainer(redis_url, database_url, stack, tmp_path, fault=fault)
        assert _wait_exit(proc, 300) == -9
    proc = _start_trainer(redis_url, database_url, stack, tmp_path)
    try:
        for run_id in runs:
            _wait_version(database_url, run_id, 4, proc, timeout_s=300)
            wait_until(lambda r=run_id: _published_versions(redis_url, r)[-1:] == [4], 120, "v4 announced",
                       procs=[proc])
    finally:
        proc.terminate()
        proc.wait(60)
    announced = [decode(f) for _, f in redis.Redis.from_url(redis_url).xrange(WEIGHTS)]
    for run_id, twin, run_keys in zip(runs, twins, keys, strict=True):
        rows = _trained(database_url, run_id)
        assert len(rows) == len(run_keys) and {(r.task_id, r.sample_idx) for r in rows} == run_keys
        order = [m.version for m in announced if m.run_id == run_id]
        assert order == [1, 2, 3, 4], order  # each version once, each after the one before
        mine, theirs = (_final_weights(redis_url, r, tmp_path / "cache" / r) for r in (run_id, twin))
        assert mine.keys() == theirs.keys() and mine
        for name in mine:
            torch.testing.assert_close(mine[name], theirs[name], rtol=1e-4, atol=1e-6, msg=name)
