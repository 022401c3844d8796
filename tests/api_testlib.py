"""Helpers for the control-plane tests (test_api_*, test_jobs_*, test_cli_*, test_sql_*): start the real API
and jobs worker as subprocesses against the test Postgres/Redis, and store runs the way the controller and
trainer would (rows in runs, episodes, trajectories, steps, token arrays, metrics, checkpoints)."""

from __future__ import annotations

import contextlib
import subprocess
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
from sqlalchemy import create_engine
from sqlalchemy.orm import Session

from infra.local.ports import free_port
from shared.contracts.db.models import (
    Checkpoint,
    EpisodeRow,
    Metric,
    RolloutTaskRow,
    Run,
    RunEvent,
    StepRecordRow,
    TokenStreamRow,
    TrainSample,
    TrajectoryRow,
)
from tests.support.procs import start_service, stop, wait_heartbeat, wait_http

REPO = Path(__file__).resolve().parents[1]
# A model folder POST /v1/runs accepts without a hub (config.json only): for runs no worker loads.
CONFIG_ONLY_MODEL = str(REPO / "tests" / "fixtures" / "config-only-model")
ADMIN_TOKEN = "test-admin-token-0123456789"


def service_env(database_url: str, redis_url: str, data_dir: Path, **extra: str) -> dict[str, str]:
    """The environment (as `start_service` keywords) every control-plane service gets in these tests."""
    return {"database_url": database_url, "redis_url": redis_url, "data_dir": str(data_dir), **extra}


@dataclass
class LiveApi:
    url: str
    token: str
    proc: subprocess.Popen
    controller: subprocess.Popen | None = None
    jobs: subprocess.Popen | None = None

    def client(self, token: str | None = "default") -> httpx.Client:
        token = self.token if token == "default" else token
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        return httpx.Client(base_url=self.url, headers=headers, timeout=30)

    def stop(self) -> None:
        for proc in (self.jobs, self.controller):
            if proc is not None:
                stop(proc)
        stop(self.proc)


def start_api(database_url: str, redis_url: str, data_dir: Path, *, controller: bool = True, jobs: bool = False,
              **extra: str) -> LiveApi:
    """The API as a process on a free port; its output in `data_dir`/api.log. `controller`: with a controller
    beside it (`data_dir`/controller.log) that applies run commands (create, pause, resume, stop: the API asks
    it) and drives no run (MAX_RUNS=0), so the runs a test stores keep the status it gave them; False where the
    test starts the controllers that drive its runs. `jobs`: with a jobs worker beside it (`data_dir`/jobs.log),
    which stores the datasets a test uploads or deletes through the API."""
    port = free_port()
    Path(data_dir).mkdir(parents=True, exist_ok=True)
    worker = start_jobs(database_url, redis_url, data_dir, WORKER_ID=f"jobs-api-{port}") if jobs else None
    ctl = None
    if controller:
        ctl = start_service("services.controller.main", log=Path(data_dir) / "controller.log",
                            **service_env(database_url, redis_url, data_dir, MAX_RUNS="0", WORKER_ID=f"ctl-api-{port}"))
    proc = start_service("services.api.main", log=Path(data_dir) / "api.log",
                         **service_env(database_url, redis_url, data_dir, API_PORT=str(port), API_TOKEN=ADMIN_TOKEN,
                                       API_HOST="127.0.0.1", **extra))
    live = LiveApi(f"http://127.0.0.1:{port}", ADMIN_TOKEN, proc, ctl, worker)
    try:  # a start that fails or times out leaves no process behind (it would outlive the test)
        wait_http(live.url + "/healthz", proc, timeout_s=90)  # its imports alone take 15 s on a loaded 2-core box
        if ctl is not None:
            wait_heartbeat(redis_url, "controller", f"ctl-api-{port}", ctl)
        if worker is not None:
            wait_heartbeat(redis_url, "jobs", f"jobs-api-{port}", worker)
    except BaseException:
        live.stop()
        raise
    return live


@contextlib.contextmanager
def running_api(database_url: str, redis_url: str, data_dir: Path, *, controller: bool = True, jobs: bool = False,
                **extra: str) -> Iterator[LiveApi]:
    """`start_api` for the length of a `with` block (a module fixture), stopped afterwards."""
    live = start_api(database_url, redis_url, data_dir, controller=controller, jobs=jobs, **extra)
    try:
        yield live
    finally:
        live.stop()


def start_jobs(database_url: str, redis_url: str, data_dir: Path, **extra: str) -> subprocess.Popen:
    Path(data_dir).mkdir(parents=True, exist_ok=True)
    return start_service("services.jobs.main", log=Path(data_dir) / "jobs.log",
                         **service_env(database_url, redis_url, data_dir, JOBS_POOL="threads", JOBS_CONCURRENCY="2",
                                       **extra))


def run_config(dataset: str, **over) -> dict:
    cfg = {"name": "test-run", "kind": "train", "model": CONFIG_ONLY_MODEL, "dataset": dataset,
           "agent": {"name": "math"}, "env": {"name": "math"}, "samples_per_task": 2, "tasks_per_batch": 2}
    cfg.update(over)
    return cfg


REASONS = ("env_done", "max_steps", "response_truncation", "env_done")


def trainer_metrics(v: int) -> list[tuple[str, float]]:
    """Metric rows per step under the names the trainer writes (services/trainer/learner.py, and verl's
    rollout_corr/* through services/trainer/algorithm.py; the docs test checks these names against them)."""
    return [("reward_mean", 0.2 + 0.2 * v), ("ppo_kl", 0.01 * v), ("kl_behaviour", 0.002 * v),
            ("entropy", 1.0 - 0.1 * v), ("tokens_per_s", 300.0 + v),
            ("logprob_diff_mean", 0.001 * (v + 1)), ("logprob_diff_max", 0.01 * (v + 1)),
            ("is_truncated_fraction", 0.05 * v),
            # verl's names: the rollout-correction set (services/trainer/algorithm.py) and the async set
            ("rollout_corr/rollout_is_mean", 1.0 - 0.01 * v), ("rollout_corr/rollout_is_eff_sample_size", 0.9 + 0.01 * v),
            ("rollout_corr/k3_kl", 0.001 * (v + 1)), ("rollout_corr/chi2_token", 0.002 * (v + 1)),
            ("fully_async/trainer/idle_ratio", 0.5 - 0.1 * v), ("fully_async/rollouter/idle_ratio", 0.2),
            ("fully_async/partial/partial_ratio", 0.1 * v), ("fully_async/count/stale_samples_processed", float(v)),
            ("fully_async/partial/max_partial_span", float(min(v, 1)))]


def seed_run(database_url: str, *, name: str = "seeded", kind: str = "train", status: str = "running",
             num_tasks: int = 4, samples: int = 2, versions: int = 3, dataset: str = "seed-ds") -> uuid.UUID:
    """Store a run as the controller/trainer would have: per version, every (task, sample) as an episode with
    one two-step trajectory, plus ledger rows, metrics per version and a checkpoint per version."""
    engine = create_engine(database_url)
    with Session(engine) as s:
        run = Run(name=name, kind=kind, status=status, policy_version=versions - 1, summary={},
                  config=run_config(dataset, name=name, kind=kind, samples_per_task=samples))
        s.add(run)
        s.flush()
        for v in range(versions):
            _seed_version(s, run.id, v, num_tasks, samples)
            for metric, value in trainer_metrics(v):
                s.add(Metric(run_id=run.id, name=metric, step=v, value=value))
            s.add(Checkpoint(run_id=run.id, version=v, uri=f"file:///weights/{run.id}/v{v}", path=None,
                             sha256="0" * 64, bytes=1000, metrics={}, status="available"))
        s.add(RunEvent(run_id=run.id, kind="status_changed", message="running", data={}))
        s.commit()
        run_id = run.id
    engine.dispose()
    return run_id


def _seed_version(s: Session, run_id: uuid.UUID, v: int, num_tasks: int, samples: int) -> None:
    for t in range(num_tasks):
        for k in range(samples):
            correct = (t + k + v) % 2 == 0 or v == 2
            reason = REASONS[(t + k) % len(REASONS)]
            ep = EpisodeRow(run_id=run_id, task_id=f"task-{t}", sample_idx=k + v * samples, attempt=0,
                            status="completed", termination_reason=reason, is_correct=correct,
                            reward=1.0 if correct else 0.0, batch_idx=v, policy_version_min=v,
                            policy_version_max=v, task={"question": f"What is {t}+{t}?", "answer": str(2 * t)},
                            metrics={}, info={}, worker_id="w1")
            s.add(ep)
            s.flush()
            s.add(RolloutTaskRow(run_id=run_id, task_id=f"task-{t}", sample_idx=k + v * samples, attempt=0,
                                 status="completed", batch_idx=v, dispatch_version=v))
            # what the trainer consumed: trained on at the next version, task-0's first group filtered out
            s.add(TrainSample(run_id=run_id, task_id=f"task-{t}", sample_idx=k + v * samples, attempt=0,
                              status="filtered" if (t, v) == (0, 0) else "used", version=v + 1,
                              generated_version=v))
            _seed_trajectory(s, run_id, ep, reason, correct, v)


def _seed_trajectory(s: Session, run_id, ep: EpisodeRow, reason: str, correct: bool, v: int) -> None:
    traj = TrajectoryRow(episode_id=ep.id, run_id=run_id, task_id=ep.task_id, sample_idx=ep.sample_idx,
                         attempt=0, traj_idx=0, uid=uuid.uuid4().hex, name="solver", reward=ep.reward,
                         termination_reason=reason, num_steps=2, prompt_tokens=30, response_tokens=12 + v,
                         policy_version_min=v, policy_version_max=v, mismatch=False,
                         info={} if correct else {"tool_call_errors": 2})  # a wrong answer after two bad tool calls
    s.add(traj)
    s.flush()
    answer = ep.task["answer"] if correct else "7"
    for i in range(2):
        msgs = [{"role": "user", "content": ep.task["question"]},
                {"role": "assistant", "content": f"step {i}: the answer is \\boxed{{{answer}}}"}]
        s.add(StepRecordRow(trajectory_id=traj.id, step_idx=i, chat_added=msgs, chat_from=i,
                            observation=ep.task["question"], thought="", action=answer,
                            model_response=msgs[-1]["content"], reward=ep.reward if i == 1 else 0.0, done=i == 1,
                            mc_return=ep.reward, info={}, weight_version=v, prompt_tokens=15, response_tokens=6,
                            gen_ms=5.0, env_ms=1.0, tokens_in_stream=False))
    s.add(TokenStreamRow(trajectory_id=traj.id, step_idx=-1, prompt_ids=[1, 2, 3], response_ids=[4, 5, 6],
                         logprobs=[-0.1, -0.2, -0.3], loss_mask=[1, 1, 1], versions=[v, v, v]))
