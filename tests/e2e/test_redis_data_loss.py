"""Redis loses its data again and again while trajectories are in flight (the services run as processes).

Every loop that touches a consumer group (reading, reclaiming, keeping running tasks alive, acknowledging) must
take a vanished group as "Redis lost its data", not die: a dead loop stops its whole service. The run must then
finish from what Postgres holds (lost attempts are re-dispatched after their lease), nothing stored twice, and
it must not fail fast: lost leases say nothing of the run itself.
"""

from __future__ import annotations

import asyncio
import time

import pytest
from sqlalchemy import text

from shared.platform.bus import connect
from tests.support.live import accounting, insert_run, mock_llm_stack, register_dataset, run_status

SERVICES = ["env-worker", "rollout-worker", "controller", "trainer"]


@pytest.mark.timeout(300)
async def test_services_survive_repeated_redis_data_loss_and_the_run_completes(isolated_urls, tmp_path):
    redis_url, database_url = isolated_urls
    env = {"CLAIM_IDLE_MS": "1500",  # the rollout worker keeps its running tasks alive every 0.5 s
           "RECLAIM_IDLE_MS": "1500", "RECLAIM_INTERVAL_S": "0.3", "STORE_CLAIM_IDLE_MS": "1500",
           "LEDGER_LEASE_MARGIN_S": "1"}
    # the mock answers after 1.5 s: tasks stay running while the groups are gone
    with mock_llm_stack(tmp_path, redis_url, database_url, SERVICES, latency_ms=1500, env=env,
                        healthy_s=120) as live:
        stack, engine = live["stack"], live["engine"]
        register_dataset(engine, "wipe-arith", 24)
        run_id = insert_run(engine, {
            "name": "wipe", "kind": "eval", "model": live["model"], "dataset": "wipe-arith", "dataset_split": "test",
            "agent": {"name": "math"}, "env": {"name": "math"}, "samples_per_task": 2, "max_response_tokens": 16,
            "engine": {"type": "openai", "base_url": live["llm"], "request_timeout_s": 10, "max_retries": 1},
            "trajectory_timeout_s": 8, "max_in_flight": 8,
        })
        deadline = time.monotonic() + 60
        while accounting(engine, run_id)["stored"] < 4:
            assert time.monotonic() < deadline, "nothing stored before the faults"
            await asyncio.sleep(0.2)
        redis = connect(redis_url)
        for _ in range(40):  # 2 s: several keepalive and reclaim periods with the groups gone under running tasks
            await redis.flushdb()
            await asyncio.sleep(0.05)
        await redis.aclose()
        for service in SERVICES:
            inst = stack.instance(service)
            assert inst.alive, f"{service} died after Redis lost its data:\n{inst.log_tail()}"
        deadline = time.monotonic() + 150
        while (status := run_status(engine, run_id)) not in ("completed", "failed", "stopped"):
            assert time.monotonic() < deadline, f"run still {status}:\n{stack.instance('controller').log_tail()}"
            await asyncio.sleep(0.5)
        assert status == "completed", _error(engine, run_id)
        counts = accounting(engine, run_id)
        assert counts["stored"] == 48 and counts["duplicates"] == 0, counts
        for service in SERVICES:
            assert stack.instance(service).alive, f"{service} died:\n{stack.instance(service).log_tail()}"


def _error(engine, run_id: str) -> str | None:
    with engine.connect() as c:
        return c.execute(text("SELECT error FROM runs WHERE id = :r"), {"r": run_id}).scalar_one()
