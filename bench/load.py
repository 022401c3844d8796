"""Load and resources: one evaluation run of many tasks through 2 rollout and 2 env workers with the mock LLM.

    python -m bench.load [--tasks 10000] [--latency-ms 20] [--in-flight 256] [--out bench/results/load.json]

Brings up a fresh system (restartable real Redis and PostgreSQL from infra/local/servers.py, the controller, 2 env
workers and 2 rollout workers of infra.local.stack, the mock LLM with the openai engine), inserts an eval run
of `--tasks` arithmetic tasks (one sample each) and, until it completes, samples every `--sample-s` seconds:
the length of every stream (rollout.tasks, trajectories, env.requests, env.inbox.*, env.replies.*) and the
RSS of every service process. The report gives, per stream, the max and final length, whether it was seen
getting shorter during the run (someone trims it), and `bounded` (trimmed, or never above a tenth of the task
count); RSS per process at start (idle, healthy), once a tenth of the run is stored (warm), and at the end;
Postgres row counts (episodes, trajectories, steps, token_arrays: one per step plus the trajectory's assembled
stream) against the ledger (rollout_tasks) and tests.support.audit's accounting; failed attempts by reason; what
consumer groups still hold pending after the run; wall time and traj/s.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil
import redis
from sqlalchemy import text

from infra.local.ports import free_port
from infra.local.servers import PostgresServer, RedisServer
from tests.support.live import (
    accounting,
    insert_run,
    register_dataset,
    start_mock_llm,
    stored_count,
    wait_run_ended,
)
from tests.support.tiny_model import build_tiny_model

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "bench" / "results" / "load.json"
STREAM_PATTERNS = ("rollout.tasks", "trajectories", "env.requests", "env.inbox.*", "env.replies.*")
SERVICES = {"controller": 1, "env-worker": 2, "rollout-worker": 2}

ROW_COUNTS = text("""
SELECT
    (SELECT count(*) FROM rollout_tasks WHERE run_id = :r) AS ledger_rows,
    (SELECT count(*) FROM rollout_tasks WHERE run_id = :r AND status = 'completed') AS ledger_completed,
    (SELECT count(*) FROM episodes WHERE run_id = :r) AS episodes,
    (SELECT count(*) FROM episodes WHERE run_id = :r AND status = 'completed') AS episodes_completed,
    (SELECT count(*) FROM trajectories WHERE run_id = :r) AS trajectories,
    (SELECT count(*) FROM steps s JOIN trajectories t ON t.id = s.trajectory_id WHERE t.run_id = :r) AS steps,
    (SELECT count(*) FROM token_arrays a JOIN trajectories t ON t.id = a.trajectory_id WHERE t.run_id = :r)
        AS token_arrays
""")


class Sampler(threading.Thread):
    """Every `period_s`: XLEN of each stream matching STREAM_PATTERNS, the stored count and each service's RSS."""

    def __init__(self, redis_url: str, engine, run_id: str, period_s: float, stack):
        super().__init__(daemon=True)
        self.client = redis.Redis.from_url(redis_url)
        self.engine, self.run_id, self.period_s, self.stack = engine, run_id, period_s, stack
        self.series: list[dict] = []
        self.halt = threading.Event()

    def run(self) -> None:
        t0 = time.monotonic()
        while not self.halt.wait(self.period_s):
            try:
                lengths = self.lengths()
            except redis.RedisError:
                continue
            self.series.append({"t_s": round(time.monotonic() - t0, 1), "stored": stored_count(self.engine, self.run_id),
                                "xlen": lengths, "rss_mb": rss_mb(self.stack)})

    def lengths(self) -> dict[str, int]:
        names = set()
        for pattern in STREAM_PATTERNS:
            names.update(k.decode() for k in self.client.scan_iter(match=pattern, _type="stream"))
        return {n: self.client.xlen(n) for n in sorted(names) if not n.endswith(".dlq")}

    def rss_warm(self, tasks: int) -> dict[str, float]:
        """RSS once a tenth of the run is stored: engines, tokenizers and pools exist, so growth after is not
        warm-up."""
        return next((s["rss_mb"] for s in self.series if s["stored"] >= tasks // 10), {})

    def summary(self, tasks: int) -> dict[str, dict]:
        out: dict[str, dict] = {}
        for sample in self.series:
            for name, n in sample["xlen"].items():
                s = out.setdefault(name, {"max": 0, "final": 0, "trimmed_during_run": False})
                s["trimmed_during_run"] |= n < s["final"]  # it got shorter: someone trims it
                s["max"], s["final"] = max(s["max"], n), n
        for s in out.values():  # bounded: trimmed as the run goes, or never near one entry per task
            s["bounded"] = s["trimmed_during_run"] or s["max"] < tasks // 10
        return out


def rss_mb(stack) -> dict[str, float]:
    out = {}
    for inst in stack.instances:
        try:
            proc = psutil.Process(inst.proc.pid)
            rss = proc.memory_info().rss + sum(c.memory_info().rss for c in proc.children(recursive=True))
        except psutil.Error:
            continue
        out[inst.label] = round(rss / 2**20, 1)
    return out


def row_counts(engine, run_id: str) -> dict[str, int]:
    with engine.connect() as c:
        return {k: int(v) for k, v in c.execute(ROW_COUNTS, {"r": run_id}).mappings().one().items()}


def failures(engine, run_id: str) -> dict:
    """Ledger rows by status, and the failed attempts' reasons (infrastructure failures, re-dispatched)."""
    with engine.connect() as c:
        ledger = dict(c.execute(text("SELECT status, count(*) FROM rollout_tasks WHERE run_id = :r GROUP BY 1"),
                                {"r": run_id}).all())
        failed = c.execute(text("SELECT termination_reason, left(error, 160), count(*) FROM episodes "
                                "WHERE run_id = :r AND status = 'failed' GROUP BY 1, 2 ORDER BY 3 DESC"),
                           {"r": run_id}).all()
    return {"ledger_by_status": ledger, "failed_attempts": [{"reason": r, "error": e, "n": n} for r, e, n in failed]}


def groups(client: redis.Redis) -> dict[str, list[dict]]:
    """Consumer groups of the grouped streams after the run: what is still pending holds back trimming."""
    out = {}
    for name in ("rollout.tasks", "trajectories", "env.requests", *sorted(
            k.decode() for k in client.scan_iter(match="env.inbox.*", _type="stream"))):
        try:
            info = client.xinfo_groups(name)
        except redis.ResponseError:
            continue
        out[name] = [{"group": g["name"].decode(), "pending": g["pending"],
                      "last_delivered": g["last-delivered-id"].decode()} for g in info]
    return out


def run_config(model: str, base_url: str, args) -> dict:
    return {
        "name": "load", "kind": "eval", "model": model, "dataset": "load-arith", "dataset_split": "test",
        "agent": {"name": "math"}, "env": {"name": "math"}, "samples_per_task": 1, "max_response_tokens": 32,
        "engine": {"type": "openai", "base_url": base_url, "request_timeout_s": 30, "max_retries": 3},
        "max_in_flight": args.in_flight, "trajectory_timeout_s": 120, "max_attempts": 3,
    }


def measure(tmp: Path, args) -> dict:
    from infra.local.stack import LocalStack
    from shared.platform.db.session import make_engine

    rs, pg = RedisServer(tmp / "redis"), PostgresServer(tmp / "postgres")
    rs.start()
    pg.start()
    port = free_port()
    mock = start_mock_llm(port, args.latency_ms)
    stack = LocalStack(tmp / "stack", env={"REDIS_URL": rs.url, "DATABASE_URL": pg.url, "LOG_FORMAT": "text"})
    engine = None
    try:
        stack.start(services=list(SERVICES), counts=SERVICES)
        stack.wait_healthy(120)
        engine = make_engine(pg.url)
        register_dataset(engine, "load-arith", args.tasks)
        model = str(build_tiny_model(tmp / "model"))
        rss_start = rss_mb(stack)
        t0 = time.monotonic()
        run_id = insert_run(engine, run_config(model, f"http://127.0.0.1:{port}/v1", args))
        sampler = Sampler(rs.url, engine, run_id, args.sample_s, stack)
        sampler.start()
        status = wait_run_ended(engine, run_id, args.timeout_s)
        wall_s = time.monotonic() - t0
        sampler.halt.set()
        sampler.join()
        final = sampler.lengths()
        counts, audit = row_counts(engine, run_id), accounting(engine, run_id)
        await_trim_s = 12  # one controller trim period after the end: what is left is not merely "not yet"
        time.sleep(await_trim_s)
        return {
            "tasks": args.tasks, "samples_per_task": 1, "rollout_workers": 2, "env_workers": 2,
            "mock_latency_ms": args.latency_ms, "max_in_flight": args.in_flight, "status": status,
            "wall_s": round(wall_s, 1), "traj_per_s": round(counts["episodes"] / wall_s, 1),
            "streams": sampler.summary(args.tasks), "streams_at_end": final,
            f"streams_{await_trim_s}s_after_end": sampler.lengths(), "groups_after_run": groups(sampler.client),
            "rss_mb": {"start_idle": rss_start, "warm_10pct": sampler.rss_warm(args.tasks), "end": rss_mb(stack)},
            "rows": counts, "accounting": audit, **failures(engine, run_id),
            "rows_match_ledger": counts["episodes_completed"] == counts["ledger_completed"] == audit["stored"]
                                 == counts["trajectories"] == counts["steps"] == counts["token_arrays"] // 2
                                 and audit["lost"] == 0 and audit["duplicates"] == 0,
            "series": sampler.series[:: max(1, len(sampler.series) // 60)],  # at most ~60 points
        }
    finally:
        stack.stop()
        mock.terminate()
        mock.wait(10)
        if engine is not None:
            engine.dispose()
        rs.stop()
        pg.stop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tasks", type=int, default=10_000)
    ap.add_argument("--latency-ms", type=float, default=20)
    ap.add_argument("--in-flight", type=int, default=256, help="run's max_in_flight")
    ap.add_argument("--sample-s", type=float, default=2.0, help="stream/RSS sampling period, seconds")
    ap.add_argument("--timeout-s", type=float, default=3600)
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="fw-load-"))
    report = measure(tmp, args)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    brief = {k: report[k] for k in ("status", "wall_s", "traj_per_s", "rows_match_ledger", "accounting")}
    print(json.dumps({**brief, "streams": report["streams"], "rss_mb": report["rss_mb"]}, indent=1))
    if report["status"] == "completed" and not report["failed_attempts"]:
        shutil.rmtree(tmp, ignore_errors=True)
    else:
        print(f"logs kept in {tmp / 'stack' / 'logs'}", file=sys.stderr)
    sys.exit(0 if report["status"] == "completed" and report["rows_match_ledger"] else 1)


if __name__ == "__main__":
    main()
