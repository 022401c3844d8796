"""A multi-turn episode that outgrows the model's context window (max_context_tokens), through the real controller,
rollout worker and env worker with the mock LLM answering long: every episode ends as `context_exceeded`, is
stored (status completed, its steps kept, every call within the window), nothing is lost or doubled
(tests.support.audit), and the same worker processes then serve a run whose window holds its episodes."""

from __future__ import annotations

import httpx
import pytest
from sqlalchemy import text

from services.jobs.builtin_datasets import generate
from shared.stores.datasets import DatasetRegistry
from tests.support.live import REPO, accounting, insert_run, mock_llm_stack, wait_run_ended

TASKS = 3
ANSWER = "x " * 200  # 400 tokens (the mock's ids are characters without --tokenizer): longer than any budget here


@pytest.fixture(scope="module")
def live(isolated_urls, tmp_path_factory):
    redis_url, database_url = isolated_urls
    with mock_llm_stack(tmp_path_factory.mktemp("context"), redis_url, database_url,
                        ["env-worker", "rollout-worker", "controller"], answer=ANSWER,
                        env={"PYTHONPATH": str(REPO)}) as live:
        # five turns: the env never ends an episode before the window does
        DatasetRegistry(live["engine"]).register("digits5", generate("digits", TASKS, seed=5, turns=5), "test")
        stack = live["stack"]
        yield live | {"pids": {name: stack.instance(name).proc.pid for name in ("env-worker", "rollout-worker")}}


def config(live, name: str, **budgets) -> dict:
    return {
        "name": name, "kind": "eval", "model": live["model"], "dataset": "digits5", "dataset_split": "test",
        "agent": {"name": "digits"}, "env": {"name": "digits"}, "max_steps": 5, "max_prompt_tokens": 64,
        "trajectory_timeout_s": 30, "max_in_flight": 4,
        "engine": {"type": "openai", "base_url": live["llm"], "request_timeout_s": 10, "max_retries": 1},
        **budgets,
    }


def trajectories(engine, run_id: str) -> list[dict]:
    """Stored trajectories with their episode's status and reason, and each step's (prompt, response) lengths."""
    with engine.connect() as c:
        rows = c.execute(text(
            "SELECT e.status, e.termination_reason AS episode_reason, t.termination_reason, t.num_steps, "
            "  (SELECT array_agg(json_build_array(cardinality(a.prompt_ids), cardinality(a.response_ids)) "
            "          ORDER BY a.step_idx) FROM token_arrays a WHERE a.trajectory_id = t.id AND a.step_idx >= 0) "
            "  AS calls "
            "FROM episodes e JOIN trajectories t ON t.episode_id = e.id WHERE e.run_id = :r"), {"r": run_id})
        return [dict(r._mapping) for r in rows]


def test_an_episode_past_the_context_window_ends_as_context_exceeded_and_is_stored(live):
    # the first prompt is ~16 tokens; turn 1 answers 64, turn 2's prompt (~90) leaves the rest of the 128 to its
    # answer, and turn 3's prompt no longer fits
    engine = live["engine"]
    run_id = insert_run(engine, config(live, "overflow", max_response_tokens=64, max_context_tokens=128))
    assert wait_run_ended(engine, run_id, 60) == "completed", live["stack"].instance("rollout-worker").log_tail()
    counts = accounting(engine, run_id)
    assert counts["stored"] == counts["dispatched"] == TASKS, counts
    assert counts["lost"] == 0 and counts["duplicates"] == 0 and counts["errored"] == 0, counts
    rows = trajectories(engine, run_id)
    assert len(rows) == TASKS
    for row in rows:
        assert (row["status"], row["episode_reason"], row["termination_reason"]) == (
            "completed", "context_exceeded", "context_exceeded"), row
        calls = row["calls"]
        assert row["num_steps"] == len(calls) >= 1  # the turns before the window filled are kept
        assert all(prompt + response <= 128 for prompt, response in calls), row
        assert calls[0][1] == 64 and calls[-1][0] + calls[-1][1] == 128, row  # whole budget first, then the rest


def test_the_workers_survive_and_serve_a_run_whose_window_holds_its_episodes(live):
    engine, stack = live["engine"], live["stack"]
    run_id = insert_run(engine, config(live, "fits", max_response_tokens=400, max_context_tokens=4096))
    assert wait_run_ended(engine, run_id, 60) == "completed"
    counts = accounting(engine, run_id)
    assert counts["stored"] == TASKS and counts["lost"] == 0 and counts["duplicates"] == 0, counts
    assert {r["termination_reason"] for r in trajectories(engine, run_id)} == {"env_done"}
    assert {r["num_steps"] for r in trajectories(engine, run_id)} == {5}
    for name, pid in live["pids"].items():
        inst = stack.instance(name)
        assert inst.alive and inst.proc.pid == pid, f"{name} was restarted or died:\n{inst.log_tail()}"
        assert httpx.get(inst.health_url, timeout=5).status_code == 200
