"""User env/agent code that raises, hangs or returns the wrong types (tests/fixtures/fw_fault_plugins.py),
run through the real controller, rollout worker and env worker (mock LLM, openai engine).

A user-code fault (ERROR, ENV_TIMEOUT) ends its episode as `error`, never as a scored episode with reward 0: the
stored error says where it came from ("env <name>.reset: ...", "agent <Class>.update_from_model: ...") and what;
a run none of whose units scored ends `failed` with that reason (never `completed`), the ledger, the API and
`run_error_reasons` count the errored units apart, with nothing lost or doubled (tests.support.audit); a trajectory
that runs past its deadline is still a scored TIMEOUT; and the same worker processes go on to serve a healthy
run afterwards.
"""

from __future__ import annotations

import shutil
import sys
import time

import httpx
import pytest
from sqlalchemy import text
from typer.testing import CliRunner

from services.api.cli import app as cli_app
from tests.support.live import (
    REPO,
    accounting,
    insert_run,
    mock_llm_stack,
    register_dataset,
    run_status,
    wait_run_ended,
)

sys.path.insert(0, str(REPO / "tests" / "integration"))
from api_testlib import start_api  # noqa: E402

FIXTURES = REPO / "tests" / "fixtures"
sys.path.insert(0, str(FIXTURES))  # RunConfig resolves the plugins' import paths here too

P = "fw_fault_plugins:"
# run name -> (env, agent, termination reason, text the stored error must contain, where it came from)
FAULTS = {
    "env_raises_in_reset": (P + "RaiseInResetEnv", "math", "error", "exploded in reset",
                            f"env {P}RaiseInResetEnv.reset: "),
    "env_raises_in_step": (P + "RaiseInStepEnv", "math", "error", "exploded in step", f"env {P}RaiseInStepEnv.step: "),
    "env_raises_in_from_dict": (P + "RaiseInFromDictEnv", "math", "error", "from_dict wants a field",
                                f"env {P}RaiseInFromDictEnv.reset: "),
    "env_hangs_in_reset": (P + "HangInResetEnv", "math", "env_timeout", "exceeded", f"env {P}HangInResetEnv.reset: "),
    "env_hangs_in_step": (P + "HangInStepEnv", "math", "env_timeout", "exceeded", f"env {P}HangInStepEnv.step: "),
    "env_step_returns_2_tuple": (P + "TwoTupleStepEnv", "math", "error", "not enough values to unpack",
                                 f"env {P}TwoTupleStepEnv.step: "),
    "env_reward_not_a_number": (P + "TextRewardEnv", "math", "error", "could not convert string to float",
                                f"env {P}TextRewardEnv.step: "),
    "env_observation_unsendable": (P + "UnsendableObservationEnv", "math", "error", "cannot be sent",
                                   f"env {P}UnsendableObservationEnv."),
    "agent_raises": ("math", P + "RaisingAgent", "error", "user agent exploded", "agent RaisingAgent.update_from_model: "),
    "agent_returns_non_action": ("math", P + "NonActionAgent", "error", "Error",
                                 "agent NonActionAgent.update_from_model: "),
    "workflow_raises": ("math", "math", "error", "user workflow exploded", "workflow RaisingWorkflow: "),
}
WORKFLOWS = {"workflow_raises": P + "RaisingWorkflow"}  # fault run -> the workflow it runs instead of the agent loop
TASKS = 2


@pytest.fixture(scope="module")
def live(isolated_urls, tmp_path_factory):
    redis_url, database_url = isolated_urls  # its controller would otherwise resume earlier modules' runs
    tmp = tmp_path_factory.mktemp("faults")
    env = {"PYTHONPATH": f"{REPO}:{FIXTURES}", "FW_FAULT_HANG_S": "3", "FW_FAULT_AGENT_HANG_S": "2.5",
           "ENV_REPLY_MARGIN_S": "10"}  # an env call's reply is waited for this long past its limit
    with mock_llm_stack(tmp, redis_url, database_url, ["env-worker", "rollout-worker", "controller"], env=env) as live:
        engine, stack = live["engine"], live["stack"]
        for seed, name in enumerate(["shared", *FAULTS], start=1):  # own task ids per fault run (see below)
            register_dataset(engine, f"faults-{name}", TASKS, seed=seed)
        register_dataset(engine, "faults-smoke40", 40, seed=99)  # a 40-unit smoke run's dataset
        pids = {name: stack.instance(name).proc.pid for name in ("env-worker", "rollout-worker")}
        api = start_api(database_url, redis_url, tmp / "api", controller=False)
        try:
            yield live | {"pids": pids, "api": api, "tmp": tmp}
        finally:
            api.stop()


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
    runs = {name: insert_run(live["engine"], config(live, name, env, agent, **(
                {"workflow": {"name": WORKFLOWS[name]}} if name in WORKFLOWS else {})))
            for name, (env, agent, *_) in FAULTS.items()}
    for run_id in runs.values():
        wait_run_ended(live["engine"], run_id, 60)  # the runs go on together: the first wait takes the time
    return runs


@pytest.mark.parametrize("fault", list(FAULTS))
def test_fault_ends_the_episode_as_error_and_fails_the_run_with_its_reason(live, fault_runs, fault):
    engine, run_id = live["engine"], fault_runs[fault]
    _, _, reason, needle, where = FAULTS[fault]
    assert run_status(engine, run_id) == "failed", live["stack"].instance("controller").log_tail()
    with engine.connect() as c:
        error = c.execute(text("SELECT error FROM runs WHERE id = :r"), {"r": run_id}).scalar()
        ledger = c.execute(text("SELECT units_total, units_completed, units_errored, attempts_errored "
                                "FROM run_ledger WHERE run_id = :r"), {"r": run_id}).one()
        reasons = c.execute(text("SELECT outcome, reason, units FROM run_error_reasons WHERE run_id = :r"),
                            {"r": run_id}).all()
    assert where in error and needle in error, error
    assert tuple(ledger) == (TASKS, 0, TASKS, TASKS), ledger
    [(outcome, top, units)] = reasons
    assert outcome == "error" and top.startswith(where) and needle in top and units == TASKS
    counts = accounting(engine, run_id)
    assert counts["dispatched"] == counts["errored"] == TASKS and counts["stored"] == 0
    assert counts["lost"] == 0 and counts["duplicates"] == 0
    rows = episodes(engine, run_id)
    assert len(rows) == TASKS, rows
    for row in rows:
        assert row["status"] == "error" and row["termination_reason"] == reason, row
        assert row["error"].startswith(where) and needle in row["error"].split("\n")[0], row


def test_agent_hanging_past_the_trajectory_deadline_times_out(live, fault_runs):
    """The agent blocks 2.5 s in update_from_model; the trajectory's budget is 1 s."""
    engine = live["engine"]
    run_id = insert_run(engine, config(live, "agent_hangs", "math", P + "HangingAgent", dataset="shared",
                                       trajectory_timeout_s=1, max_tasks=1))
    assert wait_run_ended(engine, run_id, 45) == "completed", live["stack"].instance("rollout-worker").log_tail()
    counts = accounting(engine, run_id)
    assert counts["stored"] == 1 and counts["lost"] == 0 and counts["duplicates"] == 0
    [row] = episodes(engine, run_id)
    assert row["status"] == "completed"  # a trajectory past its deadline is scored: TIMEOUT is the policy's
    assert row["termination_reason"] == "timeout"
    assert "trajectory deadline" in (row["error"] or "")


def test_concurrent_runs_on_one_dataset_keep_their_env_sessions_apart(live, fault_runs):
    """Two runs over the same task ids at once: one with an env that raises in step, one healthy."""
    engine = live["engine"]
    broken = insert_run(engine, config(live, "same_ids_broken", P + "RaiseInStepEnv", "math", dataset="shared"))
    healthy = insert_run(engine, config(live, "same_ids_healthy", "math", "math", dataset="shared"))
    assert wait_run_ended(engine, healthy, 45) == "completed"
    assert wait_run_ended(engine, broken, 45) == "failed"  # nothing scored
    got = {name: {r["termination_reason"] for r in episodes(engine, run)}
           for name, run in (("broken", broken), ("healthy", healthy))}
    assert got == {"broken": {"error"}, "healthy": {"env_done"}}


def test_workers_survive_and_serve_a_healthy_run_afterwards(live, fault_runs):
    engine, stack = live["engine"], live["stack"]
    run_id = insert_run(engine, config(live, "healthy", "math", "math", dataset="shared", samples_per_task=2))
    assert wait_run_ended(engine, run_id, 45) == "completed"
    counts = accounting(engine, run_id)
    assert counts["stored"] == 2 * TASKS and counts["lost"] == 0 and counts["duplicates"] == 0
    assert {r["termination_reason"] for r in episodes(engine, run_id)} == {"env_done"}
    for name, pid in live["pids"].items():
        inst = stack.instance(name)
        assert inst.alive and inst.proc.pid == pid, f"{name} was restarted or died:\n{inst.log_tail()}"
        assert httpx.get(inst.health_url, timeout=5).status_code == 200


def run_error(engine, run_id: str) -> str:
    with engine.connect() as c:
        return c.execute(text("SELECT error FROM runs WHERE id = :r"), {"r": run_id}).scalar()


def dispatched(engine, run_id: str) -> int:
    with engine.connect() as c:
        return c.execute(text("SELECT count(*) FROM rollout_tasks WHERE run_id = :r"), {"r": run_id}).scalar()


def test_a_smoke_run_whose_env_always_raises_fails_fast_with_where_and_why(live, fault_runs, monkeypatch):
    """40 units, `reset` always raises: the run fails after 10 errored units in a row (the default
    fail_fast_after_errors) with the reason, and GET /v1/runs/{id}, `runs show` and `runs watch` count the errored
    units apart from the scored ones, with the top reason beside them."""
    engine = live["engine"]
    run_id = insert_run(engine, config(live, "smoke-env-raises", P + "RaiseInResetEnv", "math", dataset="smoke40"))
    assert wait_run_ended(engine, run_id, 60) == "failed"
    error = run_error(engine, run_id)
    where = f"env {P}RaiseInResetEnv.reset: RuntimeError: user env exploded in reset"
    assert error == f"10 units in a row ended in a user-code error: {where}", error
    assert dispatched(engine, run_id) < 40  # failed fast: the rest were never dispatched
    with live["api"].client() as api:
        run = api.get(f"/v1/runs/{run_id}").json()
    units = run["ledger"]["units"]
    assert run["status"] == "failed" and units["completed"] == 0 and units["errored"] >= 10
    assert sum(v for k, v in units.items() if k != "total") == units["total"]
    [top] = run["ledger"]["top_reasons"]
    assert top["outcome"] == "error" and top["reason"] == where and top["units"] == units["errored"]
    assert run["pass_at_k"] == {}  # nothing scored: no pass@k, never a 0.0 that reads as "the model scores 0"
    monkeypatch.setenv("FLYWHEEL_API_URL", live["api"].url)
    monkeypatch.setenv("FLYWHEEL_TOKEN", live["api"].token)
    shown = CliRunner().invoke(cli_app, ["runs", "show", run_id], catch_exceptions=False).output
    assert f"errored {units['errored']}" in shown and where in shown, shown
    watched = CliRunner().invoke(cli_app, ["runs", "watch", run_id], catch_exceptions=False)
    assert watched.exit_code == 1 and f"errored samples {units['errored']}" in watched.output, watched.output


def test_a_model_folder_that_cannot_be_loaded_fails_the_run_after_its_first_attempts(live, fault_runs):
    """Every attempt fails the same way (config.json is not JSON): 40 units, max_in_flight 256, so fail fast
    waits for the run's 40 first attempts, not max(20, 2 * 256) = 512 of them (the run has 120)."""
    engine = live["engine"]
    broken = live["tmp"] / "broken-model"
    shutil.copytree(live["model"], broken)
    (broken / "config.json").write_text("{not json")
    run_id = insert_run(engine, config(live, "smoke-broken-model", "math", "math", dataset="smoke40",
                                       model=str(broken), max_in_flight=256))
    assert wait_run_ended(engine, run_id, 90) == "failed"
    error = run_error(engine, run_id)
    assert error.startswith("40 attempts in a row failed: ") and "config.json" in error and "JSON" in error, error
    assert dispatched(engine, run_id) < 120


def test_an_agent_program_that_raises_is_an_error_not_a_zero_score(live, fault_runs):
    engine = live["engine"]
    run_id = insert_run(engine, config(live, "program-raises", "math", "math", dataset="shared",
                                       agent_program={"name": "fw_agent_programs:crashes"}))
    assert wait_run_ended(engine, run_id, 60) == "failed"
    where = "agent program fw_agent_programs:crashes: "
    assert where in run_error(engine, run_id)
    rows = episodes(engine, run_id)
    assert len(rows) == TASKS and all(r["status"] == "error" and r["error"].startswith(where) for r in rows), rows
    counts = accounting(engine, run_id)
    assert counts["errored"] == TASKS and counts["stored"] == 0 and counts["lost"] == 0


def test_a_run_with_some_scored_units_completes_and_counts_the_errored_apart(live, fault_runs, monkeypatch):
    """Half the tasks raise in the env (FW_RAISE_ON_ODD), half score: the run completes; pass@k is over the
    scored units, the errored are counted beside it in the summary and the ledger."""
    engine = live["engine"]
    run_id = insert_run(engine, config(live, "half-errors", P + "RaiseOnOddEnv", "math", dataset="smoke40",
                                       max_tasks=8))
    assert wait_run_ended(engine, run_id, 60) == "completed", run_error(engine, run_id)
    with live["api"].client() as api:
        run = api.get(f"/v1/runs/{run_id}").json()
    units = run["ledger"]["units"]
    assert units["completed"] == 4 and units["errored"] == 4 and units["total"] == 8, units
    assert run["summary"]["scored"] == 4 and run["summary"]["errored"] == 4
    assert run["summary"]["top_reasons"][0]["status"] == "error"
    assert set(run["pass_at_k"]) == {"pass@1"}
    monkeypatch.setenv("FLYWHEEL_API_URL", live["api"].url)
    monkeypatch.setenv("FLYWHEEL_TOKEN", live["api"].token)
    shown = CliRunner().invoke(cli_app, ["runs", "show", run_id], catch_exceptions=False).output
    assert "pass@k over 4 scored samples (4 errored, 0 failed)" in shown, shown


def test_a_paused_run_says_so_in_the_api_and_runs_show(live, fault_runs, monkeypatch):
    engine = live["engine"]
    run_id = insert_run(engine, config(live, "paused", "math", P + "HangingAgent", dataset="smoke40"))
    with live["api"].client() as api:
        deadline = time.monotonic() + 30
        while api.get(f"/v1/runs/{run_id}").json()["status"] != "running":
            assert time.monotonic() < deadline
            time.sleep(0.2)
        assert api.post(f"/v1/runs/{run_id}/pause").json()["status"] == "paused"
        while not (run := api.get(f"/v1/runs/{run_id}").json())["stall_reason"]:
            assert time.monotonic() < deadline + 30, run
            time.sleep(0.2)
        assert run["stall_reason"].startswith("paused: resume it") and run["stalled_since"]
        monkeypatch.setenv("FLYWHEEL_API_URL", live["api"].url)
        monkeypatch.setenv("FLYWHEEL_TOKEN", live["api"].token)
        shown = CliRunner().invoke(cli_app, ["runs", "show", run_id], catch_exceptions=False).output
        assert "stalled" in shown and "paused: resume it" in shown, shown
        listed = api.get("/v1/runs").json()["data"]
        assert any(r["id"] == run_id and r["stall_reason"] for r in listed)
        assert api.post(f"/v1/runs/{run_id}/stop").json()["status"] == "stopping"
