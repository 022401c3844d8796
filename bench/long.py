"""Long-horizon benchmark: multi-turn tool use through the real services, a grid of turns x tokens per turn.

    make bench-long    # python -m bench.long [--turns 4,16,32 --tokens 128,1024 --episodes 256 --in-flight 128]

Per cell: a fresh stack (private Redis DB, a migrated scratch Postgres database, the controller, one env worker,
one rollout worker with `--in-flight` slots, the mock LLM in its tool-calling mode) runs an eval run of
`--episodes` episodes of the built-in `tool` agent against the `search` env (BM25 over 1,024 passages).
Every model turn is a Qwen `<tool_call>` of the search tool (a `--malformed` share of them broken JSON, which the
env answers with an error observation), its length drawn from a lognormal with mean `--tokens` (a long tail, cut
at 4x the mean: max_response_tokens); the env ends each episode after `--turns` turns, so every episode runs
exactly that many (unless the context window, `--max-context`, ends it first: counted in `terminations`).

Per cell, in bench/results/long.json (`cells`):
- episodes_per_s, generated_tokens_per_s over the run (started_at -> finished_at);
- pg_bytes: pg_total_relation_size (heap, TOAST, indexes) of the tables a result writes (episodes,
  trajectories, step_records, token_streams) after the run less their size before it (the scratch database holds this cell's run only), per generated token
  and per episode;
- redis_peak_mb: the Redis server's used_memory sampled during the run, its peak above the value before it;
- per service (controller, rollout_worker, env_worker): peak RSS and CPU ms per 1k generated tokens;
- trainer_intake: the trainer's intake path timed in this process, not a training run: the cell's stored
  episodes read back from Postgres (services/controller/store.py: load_results, what the trainer replays
  from) and turned into a batch (services/trainer/batch.py: samples_from_result, GroupBuffer, build_tensors).
`bytes_growth_exponent` / `cpu_growth_exponent`: least-squares slope of log(bytes per episode) / log(service
CPU per episode) on log(turns), per tokens-per-turn series (1.0 = linear in turns, 2.0 = quadratic), and
their mean over the series with two or more turn counts; `last_two_by_tokens_per_turn`: the slope between the
two largest turn counts only. Figures and what limits them: docs/performance.md#long-horizons.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import sys
import threading
import time
import uuid
from pathlib import Path

import psutil
import redis
from sqlalchemy import text

from bench.rollout import backing_servers, cpu_s, pg_backends, redis_server
from infra.local.ports import free_port
from services.controller.store import TABLES
from shared.platform.bus import connect_sync
from shared.platform.db.session import make_engine
from shared.platform.heartbeats import live_workers
from tests.support.growth import exponents
from tests.support.live import TERMINAL, insert_run, wait_run_ended
from tests.support.mock_llm import QUERY_WORDS, RECORDS, WORDS
from tests.support.procs import ServiceGroup, wait_until

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "bench" / "results" / "long.json"
SERVICES = ("controller", "rollout_worker", "env_worker")


# -- the workload ------------------------------------------------------------------------------------------------
def ints(text_: str) -> list[int]:
    return [int(v) for v in text_.split(",") if v.strip()]


def write_corpus(path: Path, seed: int = 0) -> Path:
    """RECORDS numbered passages of random words per query word: the mock's searches name one, so each tool
    output is a different pair of passages (a few repeated ones would compress unrealistically in storage)."""
    rng = random.Random(seed)
    with path.open("w") as f:
        for w in QUERY_WORDS:
            for n in range(RECORDS):
                words = " ".join(rng.choice(WORDS) for _ in range(20))
                f.write(json.dumps({"title": f"{w} record {n}", "text": f"The {w} record {n}: {words}."}) + "\n")
    return path


def add_dataset(engine, n: int) -> str:
    from shared.stores.datasets import DatasetRegistry

    rows = [{"id": f"long-{i}", "question": f"Which year was the {QUERY_WORDS[i % 16]} record number {i} filed?",
             "ground_truth": str(1900 + i), "data_source": "bench-long"} for i in range(n)]
    DatasetRegistry(engine).register("bench-long", rows, "test")
    return "bench-long"


def run_config(args, turns: int, tokens: int, model_dir: str, base_url: str, corpus: Path) -> dict:
    return {
        "name": f"bench-long-{turns}x{tokens}", "kind": "eval", "model": model_dir, "dataset": "bench-long",
        "dataset_split": "test", "agent": {"name": "tool"},
        "env": {"name": "search", "args": {"corpus_path": str(corpus), "max_turns": turns, "top_k": 2}},
        "engine": {"type": "openai", "base_url": base_url}, "samples_per_task": 1,
        "max_steps": turns, "max_prompt_tokens": 2048, "max_response_tokens": 4 * tokens,
        "max_context_tokens": args.max_context, "max_in_flight": args.in_flight,
        "trajectory_timeout_s": args.timeout_s, "env_step_timeout_s": 60.0,
    }


class Sampler:
    """Peak RSS per service (children included) and the Redis server's used_memory, every `every_s`."""

    def __init__(self, procs: dict[str, psutil.Process], redis_url: str, every_s: float = 0.5):
        self.procs, self.every_s = procs, every_s
        self.client = redis.Redis.from_url(redis_url)
        self.redis_base = self.redis_used()
        self.rss = dict.fromkeys(procs, 0)
        self.redis_peak = self.redis_base
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.loop, daemon=True)

    def redis_used(self) -> int:
        return int(self.client.info("memory")["used_memory"])

    def sample(self) -> None:
        for name, p in self.procs.items():
            with contextlib.suppress(psutil.Error):
                rss = p.memory_info().rss + sum(c.memory_info().rss for c in p.children(recursive=True))
                self.rss[name] = max(self.rss[name], rss)
        self.redis_peak = max(self.redis_peak, self.redis_used())

    def loop(self) -> None:
        while not self.stop.wait(self.every_s):
            self.sample()

    def __enter__(self) -> Sampler:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        self.thread.join()
        self.sample()


CELL_SQL = text("""
SELECT count(DISTINCT e.id) AS episodes, count(DISTINCT e.id) FILTER (WHERE e.status = 'completed') AS completed,
       coalesce(sum(s.response_tokens), 0) AS generated, count(s.step_idx) AS steps,
       max(s.prompt_tokens + s.response_tokens) AS max_context,
       coalesce(sum((s.info->>'num_tool_calls')::int), 0) AS calls,
       coalesce(sum((s.info->>'tool_call_errors')::int), 0) AS call_errors,
       count(*) FILTER (WHERE s.info->>'finish_reason' = 'length') AS cut_turns
FROM episodes e LEFT JOIN trajectories t ON t.episode_id = e.id LEFT JOIN steps s ON s.trajectory_id = t.id
WHERE e.run_id = :r
""")


# Where the bytes are: the assembled stream (stored once per trajectory), the steps whose arrays are not a slice
# of it (stored whole), and each step's added messages; stored (TOAST-compressed) sizes beside the raw ones.
DETAIL_SQL = text("""
SELECT (SELECT sum(pg_column_size(a.prompt_ids) + pg_column_size(a.response_ids) + pg_column_size(a.logprobs)
                   + coalesce(pg_column_size(a.loss_mask), 0) + coalesce(pg_column_size(a.versions), 0))
          FROM token_streams a WHERE a.step_idx = -1) AS assembled_arrays_stored,
       (SELECT coalesce(sum(pg_column_size(a.prompt_ids) + pg_column_size(a.response_ids)
                            + pg_column_size(a.logprobs)), 0)
          FROM token_streams a WHERE a.step_idx >= 0) AS whole_step_arrays_stored,
       (SELECT count(*) FROM step_records s WHERE NOT s.tokens_in_stream) AS steps_stored_whole,
       (SELECT sum(pg_column_size(s.chat_added)) FROM step_records s) AS step_chats_stored,
       (SELECT sum(octet_length(s.chat_added::text)) FROM step_records s) AS step_chats_raw,
       (SELECT count(*) FROM step_records s WHERE s.chat_from = s.step_idx AND s.step_idx > 0) AS chat_restarts
""")


def pg_bytes(engine) -> dict[str, int]:
    with engine.connect() as c:
        return {t: int(c.execute(text("SELECT pg_total_relation_size(CAST(:t AS regclass))"), {"t": t}).scalar())
                for t in TABLES}


def trainer_intake(engine, run_id: str) -> dict:
    """The stored episodes of the run -> one training batch, as the trainer builds it, timed here."""
    from services.controller.store import load_results
    from services.trainer.batch import GroupBuffer, build_tensors, samples_from_result

    t0 = time.perf_counter()
    with engine.connect() as c:
        results = load_results(c, run_id)
    t1 = time.perf_counter()
    buffer = GroupBuffer(samples_per_task=1, need_greedy=False)
    for r in results:
        for s in samples_from_result(r):
            buffer.add(s)
    groups = buffer.complete_groups()
    batch = build_tensors(groups, pad_id=0)
    t2 = time.perf_counter()
    tokens = int(batch["attention_mask"].sum())
    return {"what": "in process: load_results (Postgres) + samples_from_result + GroupBuffer + build_tensors over "
                    "the cell's stored episodes; no training step",
            "rows": int(batch["attention_mask"].shape[0]), "tokens": tokens,
            "padded_tokens": int(batch["attention_mask"].numel()),
            "load_s": round(t1 - t0, 3), "batch_s": round(t2 - t1, 3),
            "tokens_per_s": round(tokens / (t2 - t0)), "batch_only_tokens_per_s": round(tokens / max(t2 - t1, 1e-9))}


def run_cell(args, turns: int, tokens: int, tmp: Path, model_dir: str, corpus: Path) -> dict:
    load_before = os.getloadavg()
    with backing_servers(tmp / f"servers-{turns}x{tokens}") as (redis_url, db_url):
        engine = make_engine(db_url)
        add_dataset(engine, args.episodes)
        procs = ServiceGroup(tmp / f"logs-{turns}x{tokens}", redis_url=redis_url, database_url=db_url,
                             log_format="json", log_level="WARNING")
        port = free_port()
        procs.start("mock_llm", "tests.support.mock_llm", args=[
            "--port", str(port), "--latency-ms", str(args.latency_ms), "--tokenizer", model_dir,
            "--tool-calls", "search", "--mean-tokens", str(tokens), "--length-sigma", str(args.sigma),
            "--malformed", str(args.malformed), "--seed", str(args.seed)])
        system = {name: psutil.Process(procs.start(name, module, worker_id=f"long-{name}", **env).pid)
                  for name, module, env in [
                      ("env_worker", "services.env_worker.main", {}),
                      ("rollout_worker", "services.rollout_worker.main", {"max_concurrency": str(args.in_flight)}),
                      ("controller", "services.controller.main", {})]}
        try:
            client = connect_sync(redis_url)
            wait_until(lambda: all(live_workers(client, s) for s in ("env-worker", "rollout-worker", "controller")),
                       120, "the services' heartbeats", procs=procs.procs.values())
            others = redis_server() + pg_backends(engine)
            empty = pg_bytes(engine)  # migrated, empty tables: their pages and indexes are not the run's
            with Sampler(system, redis_url) as sampler:
                before = cpu_s([*system.values(), *others])
                run_id = insert_run(engine, run_config(args, turns, tokens, model_dir,
                                                       f"http://127.0.0.1:{port}/v1", corpus))
                status = wait_run_ended(engine, run_id, args.timeout_s, procs=procs.procs.values())
                others = redis_server() + pg_backends(engine)  # backends opened during the run count from zero
                after = cpu_s([*system.values(), *others])
            if status not in TERMINAL:
                raise TimeoutError(f"cell {turns}x{tokens}: run {run_id} did not end within {args.timeout_s}s")
            with engine.connect() as c:
                run = c.execute(text("SELECT status, error, started_at, finished_at FROM runs WHERE id = :r"),
                                {"r": run_id}).one()
                if run.status != "completed":
                    raise RuntimeError(f"cell {turns}x{tokens}: run ended {run.status}: {run.error}")
                counts = c.execute(CELL_SQL, {"r": run_id}).mappings().one()
                terminations = dict(c.execute(text(
                    "SELECT termination_reason, count(*) FROM episodes WHERE run_id = :r GROUP BY 1"),
                    {"r": run_id}).all())
            sizes = {t: n - empty[t] for t, n in pg_bytes(engine).items()}
            with engine.connect() as c:
                detail = {k: int(v or 0) for k, v in c.execute(DETAIL_SQL).mappings().one().items()}
            intake = trainer_intake(engine, run_id)
        finally:
            procs.stop()
            engine.dispose()
    cpu = {pid: after.get(pid, 0.0) - before.get(pid, 0.0) for pid in after}
    service_pids = {p.pid: name for name, p in system.items()}
    wall = (run.finished_at - run.started_at).total_seconds()
    gen, episodes = int(counts["generated"]), int(counts["episodes"])
    total = sum(sizes.values())
    service_cpu = {name: cpu.get(p.pid, 0.0) for name, p in system.items()}
    return {
        "turns": turns, "tokens_per_turn": tokens, "episodes": episodes, "completed": int(counts["completed"]),
        "terminations": terminations, "wall_s": round(wall, 2),
        "episodes_per_s": round(episodes / wall, 3), "generated_tokens": gen,
        "generated_tokens_per_s": round(gen / wall), "generated_per_turn_mean": round(gen / max(counts["steps"], 1), 1),
        "turns_cut_at_max_response": int(counts["cut_turns"]), "steps": int(counts["steps"]),
        "max_context_tokens": int(counts["max_context"] or 0),
        "malformed_call_share": round(counts["call_errors"] / max(counts["calls"], 1), 3),
        "pg_bytes": sizes, "pg_bytes_total": total, "pg_bytes_detail": detail,
        "bytes_per_generated_token": round(total / max(gen, 1), 1), "bytes_per_episode": round(total / max(episodes, 1)),
        "redis_peak_mb": round((sampler.redis_peak - sampler.redis_base) / 2**20, 2),
        "redis_used_before_mb": round(sampler.redis_base / 2**20, 2),
        "rss_peak_mb": {name: round(sampler.rss[name] / 2**20, 1) for name in SERVICES},
        "cpu_ms_per_1k_tokens": {name: round(service_cpu[name] * 1e6 / max(gen, 1), 2) for name in SERVICES}
        | {"postgres_and_redis": round(sum(v for pid, v in cpu.items() if pid not in service_pids) * 1e6
                                        / max(gen, 1), 2)},
        "service_cpu_s_per_episode": round(sum(service_cpu.values()) / max(episodes, 1), 4),
        "trainer_intake": intake,
        "loadavg_before_after": [round(load_before[0], 2), round(os.getloadavg()[0], 2)],
    }


# -- main --------------------------------------------------------------------------------------------------------
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--turns", type=ints, default=[4, 16, 32], help="turns per episode, comma-separated")
    ap.add_argument("--tokens", type=ints, default=[128, 1024], help="mean generated tokens per turn")
    ap.add_argument("--cells", default=None,
                    help="explicit TURNSxTOKENS cells instead of the grid, e.g. 4x128,16x128,32x128,4x1024")
    ap.add_argument("--episodes", type=int, default=256, help="episodes per cell")
    ap.add_argument("--in-flight", type=int, default=128, help="episodes in flight (max_in_flight, worker slots)")
    ap.add_argument("--max-context", type=int, default=65536,
                    help="max_context_tokens of the run: room for 32 turns of 1024 tokens, their tool outputs and the tail")
    ap.add_argument("--latency-ms", type=float, default=20.0, help="the mock's latency per model call")
    ap.add_argument("--sigma", type=float, default=1.0, help="lognormal shape of the response lengths")
    ap.add_argument("--malformed", type=float, default=0.1, help="share of tool calls that are not valid JSON")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--timeout-s", type=float, default=1800)
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args()
    cells = [tuple(int(v) for v in c.split("x")) for c in args.cells.split(",")] if args.cells else \
        [(t, k) for k in args.tokens for t in args.turns]
    tmp = Path(os.environ.get("TMPDIR", "/tmp")) / f"fw-bench-long-{uuid.uuid4().hex[:6]}"
    tmp.mkdir(parents=True)
    from tests.support.tiny_model import build_tiny_model

    model_dir = str(build_tiny_model(tmp / "model"))
    corpus = write_corpus(tmp / "corpus.jsonl", args.seed)
    started, out = time.time(), []
    for turns, tokens in cells:
        out.append(run_cell(args, turns, tokens, tmp, model_dir, corpus))
        print(json.dumps(out[-1]), flush=True)
        write(args, out, started, complete=len(out) == len(cells))  # after each cell: a cut-short run keeps its cells
    print(json.dumps({k: v for k, v in json.loads(args.out.read_text()).items() if k.endswith("exponent")}, indent=2))


def write(args, cells: list[dict], started: float, complete: bool) -> None:
    result = {
        "command": "python -m bench.long " + " ".join(sys.argv[1:]),
        "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "complete": complete,
        "cells": cells,
        "bytes_growth_exponent": exponents(cells, "bytes_per_episode"),
        "cpu_growth_exponent": exponents(cells, "service_cpu_s_per_episode"),
        "wall_s": round(time.time() - started, 1), "cpu_count": os.cpu_count(),
        "loadavg_end": [round(v, 2) for v in os.getloadavg()],
        "notes": NOTES,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")


NOTES = (
    "Everything on one machine (the committed run: 2 cores, shared; see loadavg_before_after per cell): mock LLM, "
    "controller, one rollout worker, one env worker, Redis, Postgres; CPU-bound, so the per-second figures are "
    "this machine's and the cells start all their episodes at once (short cells are mostly ramp). Postgres "
    "stores each trajectory's token stream once and each step's added messages (step_records.chat_added), so "
    "its bytes grow linearly; a step whose arrays are not a slice of the stream is stored whole "
    "(pg_bytes_detail.steps_stored_whole). The tiny tokenizer's ids are < 512 (two zero bytes in every int4), "
    "which TOAST compresses better than a 150k vocabulary's would, so real bytes per token are higher. What still "
    "grows with turns squared: the EpisodeResult message on Redis and the controller's decoding of it (every "
    "step carries its whole prompt ids and chat so far). Redis peak is the results of the cell's episodes "
    "waiting in the trajectories stream for the 10 s trim (they finish in one wave); used_memory is the whole "
    "server's (other databases on "
    "it count too). CPU: the rollout worker's per-turn costs (HTTP call with the whole prompt as ids, chat "
    "rendering for the token delta, per-step deep copies of the chat) dominate; the controller's grow with the "
    "message it decodes and stores. trainer_intake is timed in this process (load_results from Postgres + "
    "samples_from_result + GroupBuffer + build_tensors), not a training step."
)

if __name__ == "__main__":
    main()
