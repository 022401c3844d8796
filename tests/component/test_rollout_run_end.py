"""A rollout worker (real process, real Redis/Postgres) whose model cannot be had: a hub that never answers, a
folder without a tokenizer. The run's tasks fail at once with the loader's reason (not one hub retry per
task), a run that is stopped has its tasks dropped within seconds (no more loads for it), and SIGTERM stops
the worker within its grace period while the load still hangs.

    pytest -q tests/component/test_rollout_run_end.py
"""

from __future__ import annotations

import asyncio
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from fixtures.rollout_stack import collect_results, insert_run, make_task, publish_tasks, run_config
from sqlalchemy import create_engine, update

from shared.contracts.db.models import Run
from shared.contracts.streams import GROUP_ROLLOUT, ROLLOUT_TASKS
from shared.platform.bus import connect
from tests.support.procs import REPO, start_service, stop, wait_heartbeat, wait_until

CONFIG_ONLY = str(REPO / "tests" / "fixtures" / "config-only-model")  # config.json, no tokenizer


class HangingHub(BaseHTTPRequestHandler):
    """A hub that takes every request and answers none for a minute (a proxy that swallows them)."""

    requests: list[str] = []

    def do_HEAD(self):  # noqa: N802 (http.server's name)
        HangingHub.requests.append(self.path)
        time.sleep(60)

    do_GET = do_HEAD  # noqa: N815

    def log_message(self, *args):
        pass


def asked_for(model: str) -> int:
    """Requests for `model`'s files (huggingface_hub also asks the hub other things, e.g. on first use)."""
    return sum(f"/{model}/" in p for p in HangingHub.requests)


@pytest.fixture(scope="module")
def hub():
    server = ThreadingHTTPServer(("127.0.0.1", 0), HangingHub)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def start_worker(urls, hub: str, name: str, tmp_path):
    redis_url, database_url = urls
    proc = start_service("services.rollout_worker.main", redis_url=redis_url, database_url=database_url,
                         worker_id=name, data_dir=str(tmp_path), drain_timeout_s="1", hf_endpoint=hub,
                         hf_hub_offline=None, hf_hub_etag_timeout="120", hf_hub_download_timeout="120",
                         log=tmp_path / f"{name}.log")
    wait_heartbeat(redis_url, "rollout-worker", name, proc)
    return proc


@pytest.fixture(scope="module")
def worker(isolated_urls, hub, tmp_path_factory):
    folder = tmp_path_factory.mktemp("rollout-end")
    proc = start_worker(isolated_urls, hub, "rollout-end", folder)
    yield proc, folder / "rollout-end.log"
    stop(proc)


@pytest.fixture
async def redis(isolated_urls):
    client = connect(isolated_urls[0])
    yield client
    await client.aclose()


async def pending(redis) -> int:
    return (await redis.xpending(ROLLOUT_TASKS, GROUP_ROLLOUT))["pending"]


async def test_a_model_that_cannot_load_fails_every_task_at_once_with_the_loaders_reason(isolated_urls, worker, redis):
    run_id = insert_run(isolated_urls[1], run_config(CONFIG_ONLY))
    started = time.monotonic()
    await publish_tasks(redis, [make_task(run_id, {"id": f"q{i}", "question": "1+1?", "answer": "2"}) for i in range(6)])
    results = await collect_results(redis, run_id, expected=6, timeout_s=60)
    assert time.monotonic() - started < 30  # one load tried, not six
    errors = {r.error for r in results}
    assert len(errors) == 1 and {r.status for r in results} == {"failed"}, errors
    [error] = errors
    assert error.startswith("rollout worker cannot serve the run: ") and "config-only-model" in error, error
    log = worker[1].read_text()  # the build's failure once with its traceback; the repeats one line each
    assert log.count(f"cannot serve run {run_id}") == 6 and log.count("was the direct cause") == 1, log[-3000:]


async def test_a_stopped_runs_tasks_are_dropped_within_seconds_and_not_loaded_again(isolated_urls, worker, redis):
    run_id = insert_run(isolated_urls[1], run_config("org/hanging-model"))
    HangingHub.requests.clear()
    await publish_tasks(redis, [make_task(run_id, {"id": f"s{i}", "question": "?", "answer": "1"}) for i in range(3)])
    wait_until(lambda: asked_for("org/hanging-model"), 60, "the worker asking the hub for the model")
    assert await pending(redis) == 3  # held by the worker while the hub does not answer
    engine = create_engine(isolated_urls[1])
    with engine.begin() as c:
        c.execute(update(Run).where(Run.id == run_id).values(status="stopped"))
    engine.dispose()
    stopped = time.monotonic()
    while await pending(redis) and time.monotonic() - stopped < 10:
        await asyncio.sleep(0.2)
    assert await pending(redis) == 0, "the stopped run's tasks are still held"
    assert time.monotonic() - stopped < 6  # RUN_CHECK_S and an ack
    asked = asked_for("org/hanging-model")
    await publish_tasks(redis, [make_task(run_id, {"id": "late", "question": "?", "answer": "1"})])
    await asyncio.sleep(2)
    assert await pending(redis) == 0 and asked_for("org/hanging-model") == asked  # acked unrun: no load, no retry
    assert f"run {run_id} has ended: dropping its tasks here" in worker[1].read_text()


def test_sigterm_stops_a_worker_within_its_grace_period_while_its_model_load_hangs(isolated_urls, hub, tmp_path):
    proc = start_worker(isolated_urls, hub, "rollout-hang", tmp_path)
    try:
        run_id = insert_run(isolated_urls[1], run_config("org/another-hanging-model"))
        HangingHub.requests.clear()

        async def publish():
            client = connect(isolated_urls[0])
            await publish_tasks(client, [make_task(run_id, {"id": "h", "question": "?", "answer": "1"})])
            await client.aclose()

        asyncio.run(publish())
        wait_until(lambda: asked_for("org/another-hanging-model"), 60, "the hub asked")
        started = time.monotonic()
        stop(proc, timeout_s=60)
        took = time.monotonic() - started
    finally:
        stop(proc, timeout_s=1)
    assert proc.returncode == 0 and took < 15, (proc.returncode, took)  # DRAIN_TIMEOUT_S=1, not the hub's 60 s
