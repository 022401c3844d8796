"""The trainer as a real process: consumes what the store accepted (`results.accepted`), trains with verl,
checkpoints, records, reports to the controller and publishes through a real weight server; refills dropped
groups with a controller in front of it; runs under torchrun; logs to its trackers. Killed mid-step, it resumes:
test_trainer_resume.py."""

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
from trainer_service_testlib import (
    TASKS,
    N,
    accept,
    insert_run,
    pending,
    publish_batch,
    published_versions,
    reports,
    result,
    start_trainer,
    trained,
    wait_version,
)

from infra.local.ports import free_port
from shared.contracts.messages import (
    EpisodeResult,
    RolloutTask,
    TrajectoryRecord,
)
from shared.contracts.streams import (
    heartbeat_key,
)
from shared.weights.manifest import ADAPTER_WEIGHTS
from tests.support.procs import start_service, wait_until


def test_trainer_trains_whole_groups_reports_and_publishes(stack, redis_url, database_url, model_dir, tmp_path):
    run_id = insert_run(database_url, model_dir)
    client = redis.Redis.from_url(redis_url)
    keys = set()
    accept(client, result(run_id, "b0-t0", 0, attempt=1))
    keys.add(("b0-t0", 0))
    accept(client, result(run_id, "b0-t0", 0, attempt=1))  # published again (a re-delivery to the store)
    for s in range(1, N):
        accept(client, result(run_id, "b0-t0", s))
        keys.add(("b0-t0", s))
    for s in range(N):
        accept(client, result(run_id, "b0-t1", s))
        keys.add(("b0-t1", s))
    keys |= publish_batch(redis_url, run_id, 1, 0)
    # An incomplete group (3 of 4 samples) is never trained on.
    for s in range(N - 1):
        accept(client, result(run_id, "b2-partial", s, batch=2))

    # A run whose model cannot be loaded is reported on trainer.progress, written nowhere, and stops no other run.
    unloadable = insert_run(database_url, model_dir.parent / "no-such-model")

    proc = start_trainer(redis_url, database_url, stack, tmp_path)
    try:
        wait_version(database_url, run_id, 2, proc)
        # the commit comes first; the publish and the report of version 2 follow it (seconds under load)
        wait_until(lambda: published_versions(redis_url, run_id) == [1, 2] and
                   max((m.version for m in reports(redis_url, run_id)), default=0) == 2, 60,
                   "version 2 published and reported",
                   procs=[proc])
        errors = [m.error for m in reports(redis_url, unloadable)]
        assert len(errors) == 1 and "no-such-model" in errors[0], errors
        with create_engine(database_url).connect() as c:
            assert c.execute(text("SELECT count(*) FROM run_events WHERE run_id = :id"),
                             {"id": unloadable}).scalar() == 0  # the controller records it, not the trainer
        rows = trained(database_url, run_id)
        assert {(r.task_id, r.sample_idx) for r in rows} == keys
        assert all(r.status == "used" for r in rows)
        by_version = {v: {r.task_id for r in rows if r.version == v} for v in (1, 2)}
        assert all(len(tasks) == TASKS for tasks in by_version.values())  # whole groups, tasks_per_batch each
        assert published_versions(redis_url, run_id) == [1, 2]
        # the controller hears of each version and the groups its step used, from the trainer's reports only
        sent = reports(redis_url, run_id)
        assert max(m.version for m in sent) == 2
        used = {(g.task_id, g.batch_idx) for m in sent for g in m.groups if g.status == "used"}
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
        assert pending(redis_url) == N - 1  # only the incomplete group is still held
        with create_engine(database_url).begin() as c:  # the run stops: what it held is released
            c.execute(text("UPDATE runs SET status = 'stopping' WHERE id = :id"), {"id": run_id})
        deadline = time.monotonic() + 10
        while pending(redis_url) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert pending(redis_url) == 0
    finally:
        proc.terminate()
        proc.wait(60)


def test_lora_runs_of_one_kind_share_one_engine_in_the_trainer(stack, redis_url, database_url, model_dir, tmp_path):
    """Two LoRA runs over one base and a full-weight run in one trainer process: two engines (the LoRA runs share
    theirs, services/trainer/lora_shared_engine.py), and each run trains and publishes its own versions."""
    algorithm = {"adv_estimator": "grpo", "lr": 1e-3, "lora": {"rank": 4, "target_modules": ["q_proj", "v_proj"]}}
    runs = [insert_run(database_url, model_dir, algorithm=algorithm) for _ in range(2)]
    runs.append(insert_run(database_url, model_dir))
    for run_id in runs:
        for batch in range(2):
            publish_batch(redis_url, run_id, batch, 0)
    proc = start_trainer(redis_url, database_url, stack, tmp_path)
    try:
        for run_id in runs:
            wait_version(database_url, run_id, 2, proc)
            wait_until(lambda r=run_id: published_versions(redis_url, r) == [1, 2], 60, "v2 announced",
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
    run_id = insert_run(database_url, model_dir, status="pending", dataset=dataset, samples_per_task=2,
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
    proc = start_trainer(redis_url, database_url, stack, tmp_path)
    try:
        def status() -> str:
            with engine.connect() as c:
                return c.execute(text("SELECT status FROM runs WHERE id = :id"), {"id": run_id}).scalar()
        wait_until(lambda: status() == "completed", 120, "the run to complete", procs=(ctl, proc))
        rows = trained(database_url, run_id)
        used = [r for r in rows if r.status == "used"]
        assert sorted({r.version for r in used}) == [1, 2, 3] and len(used) == 3 * TASKS * 2
        assert not any(r.task_id == "t0" for r in used)  # never trained on a group without signal
        assert any(r.task_id == "t0" and r.status == "filtered" for r in rows)
        assert [(r.task_id, r.sample_idx) for r in rows if r.status == "incomplete"] == [(doomed[0], 0)]
        assert max(r.sample_idx for r in used) >= 2  # replacements came from a further epoch
        wait_until(lambda: pending(redis_url) == 0, 90, "the trainer to release what it held", procs=(proc,))
    finally:
        stop.set()
        for p in (ctl, proc):
            p.terminate()
            p.wait(60)
        worker.join(10)


@pytest.mark.slow
@pytest.mark.parametrize("lora", [None, {"rank": 4, "target_modules": ["q_proj", "v_proj"]}], ids=["full", "lora"])
def test_trainer_service_under_torchrun_two_ranks(stack, redis_url, database_url, model_dir, tmp_path, lora):
    """Two ranks of FSDP2, full weights and a LoRA run: a LoRA version is the whole adapter (every tensor at
    its full shape, not rank 0's shard), with the base frozen."""
    port = free_port()
    algorithm = {"adv_estimator": "grpo", "lr": 1e-3} | ({"lora": lora} if lora else {})
    run_id = insert_run(database_url, model_dir, algorithm=algorithm)
    keys = publish_batch(redis_url, run_id, 0, 0) | publish_batch(redis_url, run_id, 1, 0)
    proc = start_trainer(redis_url, database_url, stack, tmp_path, launcher=(
        "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={port}"))
    try:
        wait_version(database_url, run_id, 2, proc)
        rows = trained(database_url, run_id)
        assert {(r.task_id, r.sample_idx) for r in rows} == keys
        # a step is recorded before it is published: wait for the announcement
        wait_until(lambda: published_versions(redis_url, run_id) == [1, 2], 60, "v2 announced", procs=[proc])
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
    run_id = insert_run(database_url, model_dir, tracking={
        "wandb": {"project": "flywheel-test", "mode": "offline"}, "tensorboard": {"dir": str(tmp_path / "tb")},
        "mlflow": {"tracking_uri": down}})
    for batch in range(2):
        publish_batch(redis_url, run_id, batch, 0)
    proc = start_trainer(redis_url, database_url, stack, tmp_path, data_dir=str(tmp_path / "data"))
    try:
        wait_version(database_url, run_id, 2, proc)
        client = redis.Redis.from_url(redis_url)
        beat = lambda: json.loads(client.get(heartbeat_key("trainer", "trainer-t")) or "{}")  # noqa: E731
        wait_until(lambda: run_id in beat().get("tracker_warnings", {}), 60, "the tracker warning", procs=[proc])
        assert down in beat()["tracker_warnings"][run_id] and "mlflow" in beat()["tracker_warnings"][run_id]
        publish_batch(redis_url, run_id, 2, 2)  # trained on after the failure: its metrics count it
        wait_version(database_url, run_id, 3, proc)
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
