"""User env/agent code that raises, hangs or returns the wrong types (tests/fixtures/fw_fault_plugins.py),
run through the real controller, rollout worker and env worker (mock LLM, openai engine).

Each trajectory must end with ERROR, ENV_TIMEOUT or TIMEOUT and a stored reason (episodes.error), every
run must complete with nothing lost or doubled (shared.audit), and the same worker processes must go on to
serve a healthy run afterwards.
"""

from __future__ import annotations

import sys
import time

import httpx
import pytest
from sqlalchemy import text

from harness.live import (
    REPO,
    accounting,
    insert_run,
    register_dataset,
    run_status,
    start_mock_llm,
    wait_run_done,
)
from harness.ports import free_port
from harness.stack import LocalStack
from harness.tiny_model import build_tiny_model

FIXTURES = REPO / "tests" / "fixtures"
sys.path.insert(0, str(FIXTURES))  # RunConfig resolves the plugins' import paths here too

P = "fw_fault_plugins:"
# run name -> (env, agent, termination reason, text the stored error must contain)
FAULTS = {
    "env_raises_in_reset": (P + "RaiseInResetEnv", "math", "error", "exploded in reset"),
    "env_raises_in_step": (P + "RaiseInStepEnv", "math", "error", "exploded in step"),
    "env_raises_in_from_dict": (P + "RaiseInFromDictEnv", "math", "error", "from_dict wants a field"),
    "env_hangs_in_reset": (P + "HangInResetEnv", "math", "env_timeout", "exceeded"),
    "env_hangs_in_step": (P + "HangInStepEnv", "math", "env_timeout", "exceeded"),
    "env_step_returns_2_tuple": (P + "TwoTupleStepEnv", "math", "error", "not enough values to unpack"),
    "env_reward_not_a_number": (P + "TextRewardEnv", "math", "error", "could not convert string to float"),
    "env_observation_unsendable": (P + "UnsendableObservationEnv", "math", "error", "cannot be sent"),
    "agent_raises": ("math", P + "RaisingAgent", "error", "user agent exploded"),
    "agent_returns_non_action": ("math", P + "NonActionAgent", "error", "Error"),
}
TASKS = 2


@pytest.fixture(scope="module")
def live(redis_url, database_url, tmp_path_factory):
    from shared.db.session import make_engine

    tmp = tmp_path_factory.mktemp("faults")
    model = str(build_tiny_model(tmp / "model"))
    port = free_port()
    mock = start_mock_llm(port, latency_ms=5)
    stack = LocalStack(tmp / "stack", env={
        "REDIS_URL": redis_url, "DATABASE_URL": database_url, "LOG_FORMAT": "text", "POLL_INTERVAL_S": "0.2",
        "PYTHONPATH": f"{REPO}:{FIXTURES}", "FW_FAULT_HANG_S": "3", "FW_FAULT_AGENT_HANG_S": "2.5",
        "ENV_REPLY_MARGIN_S": "10",  # an env call's reply is waited for this long past its limit
    })
    engine = make_engine(database_url)
    try:
        stack.start(services=["env-worker", "rollout-worker", "controller"])
        stack.wait_healthy(90)
        for seed, name in enumerate(["shared", *FAULTS], start=1):  # own task ids per fault run (see below)
            register_dataset(engine, f"faults-{name}", TASKS, seed=seed)
        pids = {name: stack.instance(name).proc.pid for name in ("env-worker", "rollout-worker")}
        yield {"stack": stack, "engine": engine, "model": model, "llm": f"http://127.0.0.1:{port}/v1", "pids": pids}
    finally:
        stack.stop()
        mock.terminate()
        mock.wait(10)
        engine.dispose()


def config(live, name: str, env: str, agent: str, dataset: str = "", **overrides) -> dict:
    return {
        "name": name, "kind": "eval", "model": live["model"], "dataset": f"faults-{dataset or name}",
        "dataset_split": "test", "agent": {"name": agent}, "env": {"name": env}, "max_response_tokens": 64,
        "env_step_timeout_s": 1,
        "trajectory_timeout_s": 20, "max_in_flight": 4,
        "engine": {"type": "openai", "base_url": live["llm"], "request_timeout_s": 10, "max_retries": 1},
        **overrides,
    }


def episodes(engine, run_id: str) -> list[dict]:
    """Stored episodes, each with `reason`: episodes.error, else its trajectory's info.error."""
    with engine.connect() as c:
        rows = c.execute(text(
            "SELECT e.task_id, e.status, e.termination_reason, e.error, coalesce(e.error, t.info->>'error') AS reason "
            "FROM episodes e LEFT JOIN trajectories t ON t.episode_id = e.id AND t.traj_idx = 0 "
            "WHERE e.run_id = :r ORDER BY e.task_id, e.attempt"), {"r": run_id})
        return [dict(r._mapping) for r in rows]


@pytest.fixture(scope="module")
def fault_runs(live):
    """Every fault run at once; {name: run_id} once all have ended."""
    runs = {name: insert_run(live["engine"], config(live, name, env, agent))
            for name, (env, agent, _, _) in FAULTS.items()}
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if all(run_status(live["engine"], r) in ("completed", "failed", "stopped") for r in runs.values()):
            break
        time.sleep(0.5)
    return runs


@pytest.mark.parametrize("fault", list(FAULTS))
def test_fault_ends_the_trajectory_with_a_stored_reason(live, fault_runs, fault):
    engine, run_id = live["engine"], fault_runs[fault]
    _, _, reason, needle = FAULTS[fault]
    assert run_status(engine, run_id) == "completed", live["stack"].instance("controller").log_tail()
    counts = accounting(engine, run_id)
    assert counts["dispatched"] == counts["stored"] == TASKS and counts["lost"] == 0 and counts["duplicates"] == 0
    rows = episodes(engine, run_id)
    assert rows, "nothing stored"
    for row in rows:
        assert row["status"] == "completed" and row["termination_reason"] == reason, row
        assert row["reason"] and needle in row["reason"], row


def test_agent_hanging_past_the_trajectory_deadline_times_out(live, fault_runs):
    """The agent blocks 2.5 s in update_from_model; the trajectory's budget is 1 s."""
    engine = live["engine"]
    run_id = insert_run(engine, config(live, "agent_hangs", "math", P + "HangingAgent", dataset="shared",
                                       trajectory_timeout_s=1, max_tasks=1))
    assert wait_run_done(engine, run_id, 45), live["stack"].instance("rollout-worker").log_tail()
    counts = accounting(engine, run_id)
    assert counts["stored"] == 1 and counts["lost"] == 0 and counts["duplicates"] == 0
    [row] = episodes(engine, run_id)
    assert row["status"] == "completed"
    assert row["termination_reason"] == "timeout"
    assert "trajectory deadline" in (row["error"] or "")


def test_concurrent_runs_on_one_dataset_keep_their_env_sessions_apart(live, fault_runs):
    """Two runs over the same task ids at once: one with an env that raises in step, one healthy."""
    engine = live["engine"]
    broken = insert_run(engine, config(live, "same_ids_broken", P + "RaiseInStepEnv", "math", dataset="shared"))
    healthy = insert_run(engine, config(live, "same_ids_healthy", "math", "math", dataset="shared"))
    assert wait_run_done(engine, broken, 45) and wait_run_done(engine, healthy, 45)
    got = {name: {r["termination_reason"] for r in episodes(engine, run)}
           for name, run in (("broken", broken), ("healthy", healthy))}
    assert got == {"broken": {"error"}, "healthy": {"env_done"}}


def test_workers_survive_and_serve_a_healthy_run_afterwards(live, fault_runs):
    engine, stack = live["engine"], live["stack"]
    run_id = insert_run(engine, config(live, "healthy", "math", "math", dataset="shared", samples_per_task=2))
    assert wait_run_done(engine, run_id, 45)
    counts = accounting(engine, run_id)
    assert counts["stored"] == 2 * TASKS and counts["lost"] == 0 and counts["duplicates"] == 0
    assert {r["termination_reason"] for r in episodes(engine, run_id)} == {"env_done"}
    for name, pid in live["pids"].items():
        inst = stack.instance(name)
        assert inst.alive and inst.proc.pid == pid, f"{name} was restarted or died:\n{inst.log_tail()}"
        assert httpx.get(inst.health_url, timeout=5).status_code == 200
