"""vLLM vs HF rollouts, and vLLM hot-reload latency: `make bench-vllm` (python -m bench.vllm [--tasks 1024]).

The same tiny model (tests/support/tiny_model.py's vLLM shape: hidden 128, 4 heads of 32, untied) and the same
workload (an eval run of `tasks` single-step arithmetic tasks, sampling at temperature 1, `max_tokens`
generated tokens at most) through the real services on real Redis/Postgres: env worker and controller from
this environment, one rollout worker with `engine.type: hf` (this environment), then one with
`engine.type: vllm` (`.venv-vllm`). Then `reloads` checkpoints are published on the `weights` stream one after
another and the time from publish to the worker serving each (its rollout_weight_version gauge) is measured.

bench/results/vllm.json: vllm_traj_per_s / hf_traj_per_s (bench.rollout.steady_rate: between the 10th and 90th
percentile of finish times, after the engine start), vllm_tokens_per_s / hf_tokens_per_s (that rate times the
mean generated tokens per trajectory), reload_s_median / reload_s_first (publish -> serving), versions_served,
stored (trajectories stored by the vLLM run), tasks, and the engines' start-up (first episode start).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import redis
from sqlalchemy import text

from bench.rollout import steady_rate
from infra.local.servers import leased_redis_db, scratch_database
from shared.contracts.streams import heartbeat_key
from tests.support.live import REPO, register_dataset, stored_count, wait_run_ended
from tests.support.procs import start_service, stop, wait_heartbeat
from tests.support.tiny_model import build_vllm_tiny_model

RESULTS = REPO / "bench" / "results" / "vllm.json"
VLLM_PYTHON = REPO / os.environ.get("VLLM_VENV", ".venv-vllm") / "bin" / "python"
WORKER_ID = "bench-rollout"


def run_config(model: Path, engine: dict, tasks: int, args) -> dict:
    return {"name": f"bench-{engine['type']}", "kind": "eval", "model": str(model), "dataset": "arith",
            "dataset_split": "test", "agent": {"name": "math"}, "env": {"name": "math"}, "engine": engine,
            "sampling": {"temperature": 1.0}, "samples_per_task": 1, "max_tasks": tasks,
            "max_in_flight": args.concurrency, "max_prompt_tokens": 256, "max_response_tokens": args.max_tokens,
            "trajectory_timeout_s": 900.0}


def start_worker(python: str, stack, logs: Path, concurrency: int) -> subprocess.Popen:
    env = {**stack._base_env(), "WORKER_ID": WORKER_ID, "HEALTH_PORT": "0", "MAX_CONCURRENCY": str(concurrency),
           "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"),
           "TOKENIZERS_PARALLELISM": "false", "PYTHONPATH": str(REPO)}
    return start_service("services.rollout_worker.main", python=python, VIRTUAL_ENV=None,
                         log=logs / f"rollout-{Path(python).parts[-3]}.log", **env)


def metrics_url(redis_url: str, proc: subprocess.Popen, timeout_s: float = 120) -> str:
    health = wait_heartbeat(redis_url, "rollout-worker", WORKER_ID, proc, timeout_s)
    redis.Redis.from_url(redis_url).delete(heartbeat_key("rollout-worker", WORKER_ID))  # the next one's afresh
    return f"http://127.0.0.1:{health['port']}/metrics"


def served_version(http: httpx.Client, url: str, run_id: str) -> int:
    prefix = f'rollout_weight_version{{run_id="{run_id}"}}'
    for line in http.get(url).text.splitlines():
        if line.startswith(prefix):
            return int(float(line.split()[-1]))
    return -1


def measure_run(db, url: str, model: Path, engine: dict, args) -> tuple[dict, str]:
    """One eval run on the worker serving `url`: (figures, run id)."""
    from tests.support.live import insert_run

    run_id = insert_run(db, run_config(model, engine, args.tasks, args))
    if not wait_run_ended(db, run_id, args.timeout_s) == "completed":
        raise RuntimeError(f"the {engine['type']} run did not complete")
    with db.connect() as c:
        tokens = float(c.execute(text(
            """SELECT avg((SELECT sum(m) FROM unnest(a.loss_mask) m)) FROM token_arrays a
               JOIN trajectories t ON t.id = a.trajectory_id WHERE t.run_id = :r AND a.step_idx = -1"""),
            {"r": run_id}).scalar())
    rate = steady_rate(db, run_id)
    return {"traj_per_s": rate["steady_traj_per_s"], "tokens_per_trajectory": round(tokens, 2),
            "tokens_per_s": round(rate["steady_traj_per_s"] * tokens, 1),
            "startup_s": rate["first_episode_start_s"], "stored": stored_count(db, run_id)}, run_id


def measure_reloads(redis_url: str, url: str, run_id: str, folders: list[Path]) -> list[float]:
    """Publish versions 1.. one after another; seconds from each publish to the worker serving it."""
    from shared.contracts.messages import WeightsPublished, encode
    from shared.contracts.streams import WEIGHTS
    from shared.weights.manifest import write_manifest

    client, seconds = redis.Redis.from_url(redis_url), []
    with httpx.Client(timeout=10) as http:
        for version, folder in enumerate(folders, start=1):
            manifest, sha = write_manifest(folder, run_id, version)
            msg = WeightsPublished(run_id=run_id, version=version, uri="http://127.0.0.1:9/unused", path=str(folder),
                                   sha256=sha, bytes=manifest.total_bytes, created_at=time.time())
            start = time.perf_counter()
            client.xadd(WEIGHTS, encode(msg))
            while served_version(http, url, run_id) < version:
                if time.perf_counter() - start > 120:
                    raise TimeoutError(f"v{version} not served 120 s after its publish")
                time.sleep(0.01)
            seconds.append(time.perf_counter() - start)
    return seconds


def run_bench(args, tmp: Path, redis_url: str, database_url: str) -> dict:
    from infra.local.stack import LocalStack
    from shared.platform.db.session import make_engine

    if not VLLM_PYTHON.exists():
        raise SystemExit(f"{VLLM_PYTHON} is missing: run `make vllm-venv` first")
    db = make_engine(database_url)
    model = build_vllm_tiny_model(tmp / "model", seed=0)
    register_dataset(db, "arith", args.tasks, split="test")
    with LocalStack(data_dir=tmp, env={"REDIS_URL": redis_url, "DATABASE_URL": database_url}) as stack:
        stack.start(services=["env-worker", "controller"])
        stack.wait_healthy(180)
        logs = tmp / "logs"
        worker = start_worker(sys.executable, stack, logs, args.concurrency)
        try:
            hf, _ = measure_run(db, metrics_url(stack.redis_url, worker), model,
                                {"type": "hf", "max_batch_size": args.concurrency}, args)
        finally:
            stop(worker, 60)
        print(f"hf:   {hf}", flush=True)
        worker = start_worker(str(VLLM_PYTHON), stack, logs, args.concurrency)
        try:
            url = metrics_url(stack.redis_url, worker)
            vllm, run_id = measure_run(db, url, model, {"type": "vllm", "max_model_len": 512, "enforce_eager": True},
                                       args)
            print(f"vllm: {vllm}", flush=True)
            folders = [build_vllm_tiny_model(tmp / f"v{v}", seed=v) for v in range(1, args.reloads + 1)]
            reloads = measure_reloads(stack.redis_url, url, run_id, folders)
        finally:
            stop(worker, 60)
    db.dispose()
    return {
        "vllm_traj_per_s": vllm["traj_per_s"], "hf_traj_per_s": hf["traj_per_s"],
        "vllm_tokens_per_s": vllm["tokens_per_s"], "hf_tokens_per_s": hf["tokens_per_s"],
        "reload_s_median": round(statistics.median(reloads), 3), "reload_s_first": round(reloads[0], 3),
        "reload_s": [round(s, 3) for s in reloads], "versions_served": len(reloads),
        "stored": vllm["stored"], "hf_stored": hf["stored"], "tasks": args.tasks,
        "vllm_startup_s": vllm["startup_s"], "hf_startup_s": hf["startup_s"],
        "tokens_per_trajectory": {"vllm": vllm["tokens_per_trajectory"], "hf": hf["tokens_per_trajectory"]},
        "concurrency": args.concurrency, "max_tokens": args.max_tokens, "cpus": os.cpu_count(),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tasks", type=int, default=1024)
    parser.add_argument("--concurrency", type=int, default=64, help="trajectories in flight (and HF batch size)")
    parser.add_argument("--max-tokens", type=int, default=32, help="generated tokens per trajectory, at most")
    parser.add_argument("--reloads", type=int, default=5, help="versions published for the reload latency")
    parser.add_argument("--timeout-s", type=float, default=3600)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    base = os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0")
    admin = os.environ.get("DATABASE_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/postgres")
    with tempfile.TemporaryDirectory(prefix="bench-vllm-") as tmp, leased_redis_db(base) as redis_url, \
            scratch_database(admin) as database_url:
        result = run_bench(args, Path(tmp), redis_url, database_url)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
