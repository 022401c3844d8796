"""Runs over the real services with the rollout worker on vLLM: weight server, env worker, verl trainer and
controller from the main environment, the rollout worker (`engine.type: vllm`) from `.venv-vllm`, real
Redis/Postgres; the two environments meet only over Redis, Postgres and HTTP, as in production.

- evaluation: the run already has checkpoint v2 when the worker first sees it, so the worker loads it before
  serving (a late joiner); every stored token id is HF's greedy continuation under v2, tagged v2.
- training: the worker hot-reloads the trainer's checkpoints while the run goes on; stored trajectories carry
  at least 4 versions, and each one's stored tokens and logprobs are those of its version's checkpoint.

One rollout worker for the module (each run starts its own vLLM engine, 30-60 s)."""

from __future__ import annotations

import subprocess
import uuid
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest
from fixtures.vllm_env import hf_generate, reference_logprobs, vllm_env, vllm_python
from sqlalchemy import text
from sqlalchemy.orm import Session

from infra.local.stack import LocalStack
from shared.contracts.db.models import Checkpoint, Run
from shared.contracts.messages import WeightsPublished
from shared.contracts.run_config import RunConfig
from shared.platform.db.session import make_engine
from shared.weights.fetch import materialize
from shared.weights.manifest import write_manifest
from tests.support.live import register_dataset, wait_run_ended
from tests.support.procs import start_service, stop, wait_heartbeat
from tests.support.tiny_model import build_vllm_tiny_model

pytestmark = pytest.mark.slow
VLLM_ENGINE = {"type": "vllm", "max_model_len": 512, "enforce_eager": True}


@pytest.fixture(scope="module")
def stack(isolated_urls, tmp_path_factory):
    python = vllm_python()  # skip (or fail in CI) before starting anything
    redis_url, database_url = isolated_urls
    data = tmp_path_factory.mktemp("vllm-stack")
    db = make_engine(database_url)
    env = {"REDIS_URL": redis_url, "DATABASE_URL": database_url, "KEEP_LAST": "10"}  # every version checked
    with LocalStack(data_dir=data, env=env) as services:
        services.start(services=["weight-server", "env-worker", "trainer", "controller"])
        services.wait_healthy(180)
        env = vllm_env(services._base_env(), WORKER_ID="vllm-rollout", HEALTH_PORT="0", MAX_CONCURRENCY="16")
        log = data / "logs" / "rollout-worker-vllm.log"
        worker = start_service("services.rollout_worker.main", python=python, log=log, VIRTUAL_ENV=None,
                               PYTHONHOME=None, **env)
        try:
            health = heartbeat(redis_url, worker, log)
            yield SimpleNamespace(db=db, data=data, metrics=f"http://127.0.0.1:{health['port']}/metrics")
        finally:
            stop(worker, 60)
            db.dispose()


def heartbeat(redis_url: str, worker: subprocess.Popen, log: Path) -> dict:
    try:
        return wait_heartbeat(redis_url, "rollout-worker", "vllm-rollout", timeout_s=120)
    except TimeoutError:
        state = "running" if worker.poll() is None else f"exited with {worker.returncode}"
        raise RuntimeError(f"the vLLM rollout worker sent no heartbeat ({state}):\n{log.read_text()[-3000:]}") from None


def insert_run(db, config: dict, checkpoint: tuple | None = None) -> str:
    """A pending run (what POST /v1/runs does), with an already published checkpoint (version, folder) in
    the same transaction, so the controller never sees the run without it."""
    run_id = uuid.uuid4()
    cfg = RunConfig.model_validate(config)
    with Session(db) as s:
        s.add(Run(id=run_id, name=cfg.name, kind=cfg.kind, status="pending", config=cfg.model_dump(mode="json")))
        if checkpoint is not None:
            version, folder = checkpoint
            manifest, sha = write_manifest(folder, str(run_id), version)
            s.flush()
            s.add(Checkpoint(run_id=run_id, version=version, uri="http://127.0.0.1:9/unused", path=str(folder),
                             sha256=sha, bytes=manifest.total_bytes))
        s.commit()
    return str(run_id)


def stored_tokens(db, run_id: str) -> list:
    with db.connect() as c:
        return c.execute(text(
            """SELECT a.prompt_ids, a.response_ids, a.logprobs, a.loss_mask, a.versions FROM token_arrays a
               JOIN trajectories t ON t.id = a.trajectory_id WHERE t.run_id = :r AND a.step_idx = -1"""),
            {"r": run_id}).all()


def reloads_ok(metrics_url: str) -> float:
    for line in httpx.get(metrics_url, timeout=10).text.splitlines():
        if line.startswith('rollout_weight_reloads_total{outcome="ok"}'):
            return float(line.split()[-1])
    return 0.0


def test_eval_run_on_vllm_loads_the_current_checkpoint_first(stack):
    model = build_vllm_tiny_model(stack.data / "eval-v0", seed=0)
    current = build_vllm_tiny_model(stack.data / "eval-v2", seed=2)
    register_dataset(stack.db, "arith-eval", 4, split="test")
    config = {"name": "vllm-eval", "kind": "eval", "model": str(model), "dataset": "arith-eval",
              "dataset_split": "test", "agent": {"name": "math"}, "env": {"name": "math"}, "engine": VLLM_ENGINE,
              "sampling": {"temperature": 0.0}, "samples_per_task": 1, "max_prompt_tokens": 256,
              "max_response_tokens": 12, "trajectory_timeout_s": 600.0}
    run_id = insert_run(stack.db, config, checkpoint=(2, current))
    status = wait_run_ended(stack.db, run_id, 600)
    assert status == "completed", f"eval run {status}; logs in {stack.data / 'logs'}"
    rows = stored_tokens(stack.db, run_id)
    assert len(rows) == 4
    for prompt_ids, response_ids, logprobs, loss_mask, versions in rows:
        assert set(versions) == {2} and set(loss_mask) == {1}  # served by v2 from the first token
        ids, ref = hf_generate(current, list(prompt_ids), len(response_ids))
        assert list(response_ids) == ids  # what vLLM generated, stored token-exact
        assert list(logprobs) == pytest.approx(ref, abs=1e-4)


def test_training_run_with_vllm_rollouts_hot_reloads_the_trainers_checkpoints(stack):
    model = build_vllm_tiny_model(stack.data / "train-v0", seed=0)
    register_dataset(stack.db, "arith-train", 64, split="train")
    reloads_before = reloads_ok(stack.metrics)
    config = {"name": "vllm-train", "kind": "train", "model": str(model), "dataset": "arith-train",
              "agent": {"name": "math"}, "env": {"name": "math"}, "engine": VLLM_ENGINE,
              "sampling": {"temperature": 1.0}, "algorithm": {"adv_estimator": "grpo", "lr": 1e-3, "entropy_coeff": 0.01},
              "samples_per_task": 2, "tasks_per_batch": 2, "total_steps": 4, "max_staleness": 0,
              "max_in_flight": 4, "max_prompt_tokens": 256, "max_response_tokens": 8,
              "trajectory_timeout_s": 600.0}
    run_id = insert_run(stack.db, config)
    status = wait_run_ended(stack.db, run_id, 900)
    assert status == "completed", f"training run {status}; logs in {stack.data / 'logs'}"
    with stack.db.connect() as c:
        rows = c.execute(text("SELECT version, uri, path, sha256 FROM checkpoints WHERE run_id = :r"),
                         {"r": run_id}).all()
    # versions between snapshots are published as deltas: rebuild each one's full weights for the HF reference
    folders = {v: str(materialize(WeightsPublished(run_id=run_id, version=v, uri=uri, path=path, sha256=sha,
                                                   bytes=0, created_at=0.0), stack.data / "reference" / f"v{v}"))
               for v, uri, path, sha in rows}
    assert set(folders) >= {1, 2, 3, 4}
    folders[0] = str(model)
    assert reloads_ok(stack.metrics) - reloads_before >= 3

    by_version: dict[int, list] = {}
    for row in stored_tokens(stack.db, run_id):
        served = {v for v, m in zip(row.versions, row.loss_mask, strict=True) if m}
        assert len(served) == 1  # single-turn: one version per trajectory, tagged on every token
        by_version.setdefault(served.pop(), []).append(row)
    assert len(by_version) >= 4, sorted(by_version)  # v0 and at least 3 hot-reloaded versions served
    for version, rows in by_version.items():
        for prompt_ids, response_ids, logprobs, _, _ in rows[:2]:
            # tokens and logprobs are those of the checkpoint the trajectory is labelled with
            ref = reference_logprobs(folders[version], list(prompt_ids), list(response_ids), temperature=1.0)
            assert list(logprobs) == pytest.approx(ref, abs=1e-3), f"v{version}"
    # ... and the versions really differ (the entropy bonus moves the weights even when rewards are all 0)
    prompt_ids, response_ids, logprobs, _, _ = by_version[max(by_version)][0]
    first = reference_logprobs(folders[0], list(prompt_ids), list(response_ids), temperature=1.0)
    assert list(logprobs) != pytest.approx(first, abs=1e-3)
