"""Rollout benchmark: single-step math tasks through the real services, every trajectory stored.

    make bench-rollout        # python -m bench.rollout [--tasks 24576 --concurrency 128 --latency-ms 50]

Starts the mock LLM, one env worker, one rollout worker (openai engine pointed at the mock) and the
controller as real processes on real Redis and Postgres (REDIS_URL / DATABASE_URL if set, else a private
logical DB / database on the local servers, else embedded servers), runs an eval run over an arithmetic
dataset and writes bench/results/rollout.json (and prints it). The default 24576 tasks are >= 20 s of work
at the ~1000 traj/s of a 2-core machine, long enough for the figures to be stable; a run shorter than
--min-work-s says so in the JSON (`short_run`). Smoke run: `python -m bench.rollout --tasks 2048 --out /tmp/r.json`.

- traj_per_s over the run (started_at -> finished_at) vs ideal_traj_per_s = concurrency / latency;
- env_rtt_p50_ms / p99: latency an env step gains by going through Redis and the env worker instead of a
  direct call (sequential, idle system);
- ingest_rows_per_s: TrajectoryStore.write (decode excluded, row building, ledger and conflict handling
  included) of the run's own messages (the first --ingest-sample of them), vs raw_copy_rows_per_s: plain
  binary COPY of the same rows;
- cpu_ms_per_traj: CPU of every process of the system except the mock (services, their children, our
  Postgres backends, the Redis server), per trajectory, from psutil.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import time
import uuid
from pathlib import Path

import psutil
import redis
from sqlalchemy import insert, text

from infra.local.ports import free_port, port_open
from infra.local.servers import postgres_admin, private_redis, scratch_database
from services.controller.store import TABLES, TrajectoryStore, build_rows, copy_rows
from shared.contracts.db.models import Dataset, DatasetRow, RolloutTaskRow, Run
from shared.contracts.messages import EnvReply, EnvRequest, EpisodeResult, decode, encode
from shared.contracts.streams import ENV_REQUESTS, TRAJECTORIES, env_inbox, env_replies
from shared.platform.bus import connect_sync
from shared.platform.db.session import make_engine
from shared.platform.heartbeats import live_workers
from tests.support.live import TERMINAL, wait_run_ended
from tests.support.procs import ServiceGroup, wait_until
from tests.support.tiny_model import build_tiny_model

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "bench" / "results" / "rollout.json"


# -- backing servers ---------------------------------------------------------------------------------------------
@contextlib.contextmanager
def backing_servers(tmp: Path):
    """(redis_url, database_url): private to this benchmark, removed afterwards. REDIS_URL / DATABASE_URL, else
    the local servers on their default ports when they listen, else embedded ones in `tmp`."""
    redis_base = os.environ.get("REDIS_URL") or ("redis://127.0.0.1:6379/0" if port_open(6379) else None)
    pg_admin = os.environ.get("DATABASE_URL") or (
        "postgresql+psycopg://postgres@127.0.0.1:5432/postgres" if port_open(5432) else None)
    with (private_redis(tmp / "redis", redis_base) as redis_url, postgres_admin(tmp / "pg", pg_admin) as admin,
          scratch_database(admin) as database_url):
        yield redis_url, database_url


# -- processes ---------------------------------------------------------------------------------------------------
def cpu_s(procs: list[psutil.Process]) -> dict[int, float]:
    """CPU seconds of each process and its descendants (reaped children included)."""
    out = {}
    for p in procs:
        with contextlib.suppress(psutil.Error):
            t = p.cpu_times()
            total = t.user + t.system + t.children_user + t.children_system
            for child in p.children(recursive=True):
                with contextlib.suppress(psutil.Error):
                    ct = child.cpu_times()
                    total += ct.user + ct.system
            out[p.pid] = total
    return out


def redis_server() -> list[psutil.Process]:
    return [p for p in psutil.process_iter(["name"]) if (p.info["name"] or "").startswith("redis-server")]


def pg_backends(engine) -> list[psutil.Process]:
    with engine.connect() as c:
        pids = c.execute(text("SELECT pid FROM pg_stat_activity WHERE datname = current_database()")).scalars()
        return [psutil.Process(pid) for pid in pids if psutil.pid_exists(pid)]


# -- the workload ------------------------------------------------------------------------------------------------
def add_dataset(engine, n: int) -> str:
    from services.jobs.builtin_datasets import generate

    rows, ds = generate("arithmetic", n, seed=0), uuid.uuid4()
    with engine.begin() as c:
        c.execute(insert(Dataset).values(id=ds, name="bench-arith", split="test", source="generator", num_rows=n,
                                         info={}))
        c.execute(insert(DatasetRow), [dict(dataset_id=ds, idx=i, task_id=r["id"], data=r,
                                            data_source=r["data_source"]) for i, r in enumerate(rows)])
    return "bench-arith"


def add_run(engine, args, model_dir: str, base_url: str) -> str:
    config = {
        "name": "bench-rollout", "kind": "eval", "model": model_dir, "dataset": "bench-arith",
        "dataset_split": "test", "agent": {"name": "math"}, "env": {"name": "math"},
        "engine": {"type": "openai", "base_url": base_url}, "samples_per_task": 1,
        "max_in_flight": args.max_in_flight or 2 * args.concurrency, "max_response_tokens": 32, "trajectory_timeout_s": 120.0,
    }
    run_id = uuid.uuid4()
    with engine.begin() as c:
        c.execute(insert(Run).values(id=run_id, name="bench-rollout", kind="eval", status="pending", config=config))
    return str(run_id)


def run_row(engine, run_id: str) -> dict:
    with engine.connect() as c:
        return c.execute(text("SELECT status, started_at, finished_at, error, summary FROM runs WHERE id = :r"),
                         {"r": run_id}).one()._asdict()


# -- ingest ------------------------------------------------------------------------------------------------------
def measure_ingest(db_url: str, results: list[EpisodeResult], batch: int, repeats: int = 3) -> dict:
    """Store the run's own messages again under fresh runs: the COPY and VALUES store paths, and a raw COPY of
    the same rows. Rows per second, best of `repeats` interleaved rounds (the machine is shared and noisy)."""
    engine = make_engine(db_url)
    out = {"copy": 0.0, "values": 0.0, "raw": 0.0}
    for _ in range(repeats):
        for method in ("copy", "values"):
            out[method] = max(out[method], _store_rate(engine, _rekeyed(engine, results), method, batch))
        out["raw"] = max(out["raw"], _raw_rate(engine, _rekeyed(engine, results), batch))
    engine.dispose()
    return out


def _store_rate(engine, results: list[EpisodeResult], method: str, batch: int) -> float:
    store = TrajectoryStore(engine, method=method)
    t0, rows = time.perf_counter(), 0
    for i in range(0, len(results), batch):
        rows += store.write(results[i:i + batch]).rows
    return rows / (time.perf_counter() - t0)


def _raw_rate(engine, results: list[EpisodeResult], batch: int) -> float:
    t0, rows = time.perf_counter(), 0
    with engine.begin() as conn:
        cur = conn.connection.driver_connection.cursor()
        for i in range(0, len(results), batch):
            for table, table_rows in build_rows(results[i:i + batch]).items():
                rows += len(table_rows)
                copy_rows(cur, table, TABLES[table], table_rows)  # same encoding the store uses
    return rows / (time.perf_counter() - t0)


def _rekeyed(engine, results: list[EpisodeResult]) -> list[EpisodeResult]:
    run_id = uuid.uuid4()
    with engine.begin() as c:
        c.execute(insert(Run).values(id=run_id, name="ingest", kind="eval", status="completed", config={}))
        c.execute(insert(RolloutTaskRow), [dict(run_id=run_id, task_id=r.task_id, sample_idx=r.sample_idx,
                                                attempt=r.attempt, status="dispatched", batch_idx=0, epoch=0,
                                                greedy=False, dispatch_version=0) for r in results])
    return [r.model_copy(update={"run_id": str(run_id)}) for r in results]


def read_results(redis_url: str, run_id: str, limit: int) -> list[EpisodeResult]:
    client = redis.Redis.from_url(redis_url)
    out = [decode(f) for _, f in client.xrange(TRAJECTORIES, count=limit)]
    return [r for r in out if isinstance(r, EpisodeResult) and r.run_id == run_id and r.status == "completed"]


# -- env round trip ----------------------------------------------------------------------------------------------
def measure_env_rtt(redis_url: str, n: int) -> dict:
    """Sequential math-env steps: through Redis + the env worker vs calling the env in-process."""
    from services.jobs.builtin_datasets import generate
    from shared.contracts.registry import resolve

    tasks = generate("arithmetic", n, seed=1)
    action = "The answer is \\boxed{42}."
    env_cls = resolve("env", "math")
    direct = []
    for task in tasks:
        env = env_cls.from_dict(task)
        env.reset()
        t0 = time.perf_counter()
        env.step(action)
        direct.append(time.perf_counter() - t0)
    client = redis.Redis.from_url(redis_url)
    reply_to = env_replies(f"bench-{os.getpid()}")
    via_redis, cursor = [], {reply_to: b"0-0"}  # a fresh reply stream: every entry on it is ours
    for i, task in enumerate(tasks):
        session = f"bench-{i}"
        first = _env_call(client, ENV_REQUESTS, cursor, session, "reset", task=task)
        t0 = time.perf_counter()
        _env_call(client, env_inbox(first.env_worker_id), cursor, session, "step", action=action)
        via_redis.append(time.perf_counter() - t0)
        _env_call(client, env_inbox(first.env_worker_id), cursor, session, "close")
    base = statistics.median(direct)
    added = sorted(max(0.0, t - base) * 1000 for t in via_redis)
    return {"env_rtt_p50_ms": _pct(added, 50), "env_rtt_p99_ms": _pct(added, 99),
            "env_direct_step_ms": base * 1000, "env_redis_step_p50_ms": _pct(sorted(via_redis), 50) * 1000}


def _env_call(client, stream: str, cursor: dict, session: str, op: str, **kw) -> EnvReply:
    """One request and its reply; `cursor` holds the reply stream's last-read id."""
    (reply_to,) = cursor
    rid = uuid.uuid4().hex
    client.xadd(stream, encode(EnvRequest(request_id=rid, op=op, session_id=session, run_id="bench", env="math",
                                          reply_to=reply_to, sent_at=time.time(), **kw)))
    while True:
        for _, entries in client.xread(cursor, block=5000, count=10) or []:
            for eid, fields in entries:
                cursor[reply_to] = eid
                reply = decode(fields)
                if reply.request_id == rid:
                    return reply


def _pct(sorted_values: list[float], p: float) -> float:
    return sorted_values[min(len(sorted_values) - 1, int(len(sorted_values) * p / 100))]


# -- main --------------------------------------------------------------------------------------------------------
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tasks", type=int, default=24576)
    ap.add_argument("--min-work-s", type=float, default=20.0,
                    help="a run shorter than this is flagged short_run: raise --tasks on a faster machine")
    ap.add_argument("--ingest-sample", type=int, default=4096, help="stored messages re-ingested by the ingest figures")
    ap.add_argument("--concurrency", type=int, default=128)
    ap.add_argument("--latency-ms", type=float, default=50.0)
    ap.add_argument("--max-in-flight", type=int, default=None,
                    help="the run's max_in_flight (controller's dispatch bound); default 2 x concurrency, so the "
                         "rollout worker's `concurrency` slots stay busy while finished slots are being stored")
    ap.add_argument("--env-rtt-samples", type=int, default=300)
    ap.add_argument("--timeout-s", type=float, default=600)
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args()
    tmp = Path(os.environ.get("TMPDIR", "/tmp")) / f"fw-bench-{uuid.uuid4().hex[:6]}"
    tmp.mkdir(parents=True)
    with backing_servers(tmp) as (redis_url, db_url):
        result = run_bench(args, tmp, redis_url, db_url)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


def run_bench(args, tmp: Path, redis_url: str, db_url: str) -> dict:
    model_dir = str(build_tiny_model(tmp / "model"))
    engine = make_engine(db_url)
    add_dataset(engine, args.tasks)
    procs = ServiceGroup(tmp, redis_url=redis_url, database_url=db_url, log_format="json", log_level="WARNING")
    port = free_port()
    procs.start("mock_llm", "tests.support.mock_llm", args=["--port", str(port), "--latency-ms", str(args.latency_ms),
                                                      "--tokenizer", model_dir])
    system = [psutil.Process(procs.start(name, module, worker_id=worker_id, **env).pid)
              for name, module, worker_id, env in [
                  ("env_worker", "services.env_worker.main", "bench-env", {}),
                  ("rollout_worker", "services.rollout_worker.main", "bench-rollout",
                   {"max_concurrency": str(args.concurrency)}),
                  ("controller", "services.controller.main", "bench-ctl", {"trim_interval_s": "3600"})]]
    try:
        client = connect_sync(redis_url)
        wait_until(lambda: all(live_workers(client, s) for s in ("env-worker", "rollout-worker", "controller")),
                   120, "the services' heartbeats", procs=procs.procs.values())
        others = redis_server() + pg_backends(engine)
        before = cpu_s(system + others)
        run_id = add_run(engine, args, model_dir, f"http://127.0.0.1:{port}/v1")
        status = wait_run_ended(engine, run_id, args.timeout_s, procs=procs.procs.values())
        run = run_row(engine, run_id)
        if status not in TERMINAL:
            raise TimeoutError(f"run {run_id} did not finish within {args.timeout_s}s")
        redis_pids = {p.pid for p in redis_server()}
        others = redis_server() + pg_backends(engine)  # backends opened during the run count from zero
        after = cpu_s(system + others)
        if run["status"] != "completed":
            raise RuntimeError(f"bench run ended {run['status']}: {run['error']}")
        wall = (run["finished_at"] - run["started_at"]).total_seconds()
        with engine.connect() as c:
            stored = c.execute(text("SELECT count(*) FROM trajectories WHERE run_id = :r"), {"r": run_id}).scalar()
        cpu = {p.pid: after.get(p.pid, 0.0) - before.get(p.pid, 0.0) for p in system + others}
        phases = latency_phases(engine, run_id)
        steady = steady_rate(engine, run_id)
        env_rtt = measure_env_rtt(redis_url, args.env_rtt_samples)
        ingest = measure_ingest(db_url, read_results(redis_url, run_id, args.ingest_sample), 256)
    finally:
        procs.stop()
        engine.dispose()
    names = {p.pid: n for p, n in zip(system, ["env_worker", "rollout_worker", "controller"], strict=True)}
    ideal = args.concurrency / (args.latency_ms / 1000)
    return {
        "tasks": args.tasks, "stored": stored, "concurrency": args.concurrency, "latency_ms": args.latency_ms,
        "wall_s": round(wall, 3), "short_run": wall < args.min_work_s,
        "traj_per_s": round(args.tasks / wall, 1), "ideal_traj_per_s": ideal,
        "fraction_of_ideal": round(args.tasks / wall / ideal, 3),
        **{k: round(v, 3) for k, v in env_rtt.items()},
        "ingest_rows_per_s": round(ingest["copy"]), "ingest_values_rows_per_s": round(ingest["values"]),
        "raw_copy_rows_per_s": round(ingest["raw"]),
        "cpu_ms_per_traj": round(sum(cpu.values()) * 1000 / args.tasks, 3),
        "cpu_ms_per_traj_by_process": {
            **{name: round(cpu[pid] * 1000 / args.tasks, 3) for pid, name in names.items()},
            "redis": round(sum(v for pid, v in cpu.items() if pid in redis_pids) * 1000 / args.tasks, 3),
            "postgres": round(sum(v for pid, v in cpu.items() if pid not in names and pid not in redis_pids)
                              * 1000 / args.tasks, 3),
        },
        "cpu_count": os.cpu_count(),
        "latency_phases_ms": phases,
        **steady,
        "max_in_flight": args.max_in_flight or 2 * args.concurrency,
        "notes": NOTES,
    }


NOTES = ("2-core machine, everything on it: mock LLM, rollout worker (concurrency slots), env worker, controller, "
         "Redis, Postgres. CPU-bound: cpu_ms_per_traj x traj_per_s plus the mock's own CPU is close to both cores, "
         "so queueing for a core, not waiting on I/O, stretches an episode past the mock's latency (see "
         "latency_phases_ms). Per trajectory the rollout worker spends most on the event loop and sockets (Redis "
         "pipelines, HTTP), tokenizing the prompt and building/encoding messages; Postgres on writing the episode, "
         "trajectory, step and two token-array rows and the ledger update. traj_per_s is over the whole run "
         "(first dispatch ramp included); steady_traj_per_s excludes the first and last 10%.")


PHASES_SQL = text("""
SELECT
  percentile_cont(0.5) WITHIN GROUP (ORDER BY extract(epoch FROM e.started_at - t.dispatched_at)) AS queued,
  percentile_cont(0.5) WITHIN GROUP (ORDER BY extract(epoch FROM e.finished_at - e.started_at)) AS episode,
  percentile_cont(0.5) WITHIN GROUP (ORDER BY (tr.info->>'gen_s')::float) AS generate,
  percentile_cont(0.5) WITHIN GROUP (ORDER BY (tr.info->>'env_s')::float) AS env_calls,
  percentile_cont(0.5) WITHIN GROUP (ORDER BY extract(epoch FROM t.finished_at - e.finished_at)) AS stored_after,
  avg(extract(epoch FROM e.started_at - t.dispatched_at)) AS queued_mean,
  avg(extract(epoch FROM e.finished_at - e.started_at)) AS episode_mean,
  avg(extract(epoch FROM t.finished_at - e.finished_at)) AS stored_after_mean,
  percentile_cont(0.99) WITHIN GROUP (ORDER BY extract(epoch FROM e.started_at - t.dispatched_at)) AS queued_p99,
  percentile_cont(0.99) WITHIN GROUP (ORDER BY extract(epoch FROM e.finished_at - e.started_at)) AS episode_p99,
  percentile_cont(0.99) WITHIN GROUP (ORDER BY extract(epoch FROM t.finished_at - e.finished_at)) AS stored_after_p99,
  max(extract(epoch FROM t.finished_at - t.dispatched_at)) AS slot_max
FROM rollout_tasks t
JOIN episodes e USING (run_id, task_id, sample_idx, attempt)
JOIN trajectories tr ON tr.episode_id = e.id
WHERE t.run_id = :r
""")


def steady_rate(engine, run_id: str) -> dict:
    """Trajectories stored per second between the 10th and 90th percentile of finish times: the rate once the
    workers have loaded the run (tokenizer, engine) and before the last slots drain; and the mean number of
    ledger slots in flight (dispatched, not finished) over that window, of max_in_flight."""
    with engine.connect() as c:
        t = [float(r[0]) for r in c.execute(text(
            "SELECT extract(epoch FROM finished_at) FROM rollout_tasks WHERE run_id = :r AND finished_at IS NOT NULL "
            "ORDER BY finished_at"), {"r": run_id})]
        lo, hi = t[len(t) // 10], t[len(t) * 9 // 10]
        busy = c.execute(text(
            "SELECT sum(extract(epoch FROM least(finished_at, to_timestamp(:hi)) - greatest(dispatched_at, "
            "to_timestamp(:lo)))) FROM rollout_tasks WHERE run_id = :r AND finished_at > to_timestamp(:lo) "
            "AND dispatched_at < to_timestamp(:hi)"), {"r": run_id, "lo": lo, "hi": hi}).scalar()
        first = float(c.execute(text(
            "SELECT extract(epoch FROM min(dispatched_at)) FROM rollout_tasks WHERE run_id = :r"), {"r": run_id}).scalar())
        first_start = float(c.execute(text(
            "SELECT extract(epoch FROM min(started_at)) FROM episodes WHERE run_id = :r"), {"r": run_id}).scalar())
    span = max(hi - lo, 1e-9)
    return {"steady_traj_per_s": round((len(t) * 8 // 10) / span, 1),
            "steady_mean_in_flight": round(float(busy or 0) / span, 1),
            "first_episode_start_s": round(first_start - first, 3),  # incl. the worker building the run's context
            "ramp_up_s": round(lo - first, 3), "ramp_down_s": round(t[-1] - hi, 3)}


def latency_phases(engine, run_id: str) -> dict:
    """Median per-task phases, milliseconds: where a dispatch slot's cycle time goes. queued: ledger dispatch
    -> a worker starts it; episode: reset .. last step .. close; generate / env_calls (reset, steps): inside it;
    stored_after: worker done -> ledger row finished (publish, store batch, commit)."""
    with engine.connect() as c:
        row = c.execute(PHASES_SQL, {"r": run_id}).mappings().one()
    return {k: round(float(v or 0) * 1000, 2) for k, v in row.items()}


if __name__ == "__main__":
    main()
