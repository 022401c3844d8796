"""rollout-worker + env-worker as real processes over real Redis/Postgres, HF engine, tiny local model."""

from __future__ import annotations

import json
import math
import time

import httpx
import pytest
from fixtures.rollout_stack import collect_results, insert_run, make_task, publish_tasks, run_config

from services.jobs.builtin_datasets import generate
from shared.contracts.messages import EpisodeResult, decode
from shared.platform.bus import connect
from shared.sdk.types import TerminationReason as TR
from tests.support.procs import start_service, stop, wait_heartbeat
from tests.support.tiny_model import build_tiny_model


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return str(build_tiny_model(tmp_path_factory.mktemp("tiny") / "model", seed=0))


@pytest.fixture(scope="module")
def stack(isolated_urls, tmp_path_factory):
    redis_url, database_url = isolated_urls  # no task left on the stream by an earlier module
    data = tmp_path_factory.mktemp("data")
    env = start_service("services.env_worker.main", redis_url=redis_url, worker_id="env-1")
    rollout = start_service("services.rollout_worker.main", redis_url=redis_url, database_url=database_url,
                            worker_id="rollout-1", data_dir=str(data), max_concurrency="16")
    try:
        wait_heartbeat(redis_url, "env-worker", "env-1", env)
        wait_heartbeat(redis_url, "rollout-worker", "rollout-1", rollout)
        yield {"redis_url": redis_url, "database_url": database_url}
    finally:
        out = stop(rollout) + stop(env)
        print(out[-5000:])


@pytest.fixture
async def redis(redis_url):
    client = connect(redis_url)
    yield client
    await client.aclose()


def check_tokens(result):
    for traj in result.trajectories:
        assert len(traj.response_ids) == len(traj.loss_mask) == len(traj.logprobs) == len(traj.versions)
        assert all(math.isfinite(x) and x <= 0 for x in traj.logprobs)
        for step in traj.steps:
            assert step.prompt_ids and step.response_ids and len(step.logprobs) == len(step.response_ids)
            assert step.gen_ms > 0 and step.env_ms > 0  # timed per step (steps.gen_ms / env_ms)
        assert traj.prompt_ids == traj.steps[0].prompt_ids


async def test_math_tasks_end_to_end(stack, model_path, redis):
    run_id = insert_run(stack["database_url"], run_config(model_path, samples_per_task=2))
    rows = generate("arithmetic", 4, seed=7)
    tasks = [make_task(run_id, row, s) for row in rows for s in range(2)]
    tasks.append(make_task(run_id, {**rows[0], "id": "greedy"}, greedy=True))
    await publish_tasks(redis, tasks)
    results = await collect_results(redis, run_id, expected=len(tasks))
    assert {(r.task_id, r.sample_idx) for r in results} == {(t.task_id, t.sample_idx) for t in tasks}
    for r in results:
        assert r.status == "completed", r.error
        assert r.termination_reason in (TR.ENV_DONE, TR.RESPONSE_TRUNCATION)
        assert len(r.trajectories) == 1 and len(r.trajectories[0].steps) == 1
        assert r.reward == r.trajectories[0].reward in (0.0, 1.0)
        assert r.trajectories[0].steps[0].weight_version == 0 and r.worker_id == "rollout-1"
        check_tokens(r)
    prompt = results[0].trajectories[0].steps[0].chat_completions[0]["content"]
    assert "\\boxed{}" in prompt  # the built-in MathAgent wrote it
    beat = json.loads(await redis.get("heartbeat:rollout-worker:rollout-1"))
    assert {"hf", "openai"} <= set(beat["engines"])  # what POST /v1/runs checks engine.type against


async def test_user_classes_by_import_path(stack, model_path, redis):
    config = run_config(model_path, agent={"name": "fw_user_plugins:ShoutingMathAgent"},
                        env={"name": "fw_user_plugins:PidMathEnv"})
    run_id = insert_run(stack["database_url"], config)
    await publish_tasks(redis, [make_task(run_id, row) for row in generate("arithmetic", 2, seed=1)])
    for r in await collect_results(redis, run_id, expected=2):
        assert r.status == "completed", r.error
        assert r.trajectories[0].steps[0].chat_completions[0]["content"].endswith("ANSWER NOW.")


async def test_user_env_exception_is_error_not_infra(stack, model_path, redis):
    run_id = insert_run(stack["database_url"], run_config(model_path, env={"name": "fw_user_plugins:CrashingEnv"}))
    await publish_tasks(redis, [make_task(run_id, {"id": "crash", "question": "?"})])
    [r] = await collect_results(redis, run_id, expected=1)
    assert r.status == "error" and r.termination_reason == TR.ERROR
    assert r.error.startswith("env fw_user_plugins:CrashingEnv.")  # where, then what
    assert "ZeroDivisionError" in r.error.split("\n")[0] and "ZeroDivisionError" in r.trajectories[0].info["error"]


async def test_malformed_tool_calls_add_up_per_trajectory(stack, model_path, redis):
    """The env's per-step `tool_call_errors` (error observations, the episode goes on) add up in the trajectory's
    info, which the store keeps and the API sums per run."""
    config = run_config(model_path, env={"name": "fw_user_plugins:BadToolCallsEnv"}, max_steps=5)
    run_id = insert_run(stack["database_url"], config)
    await publish_tasks(redis, [make_task(run_id, {"id": "tools", "question": "?"})])
    [r] = await collect_results(redis, run_id, expected=1)
    # the env ended it after three turns (the random model's last answer may be cut: response_truncation)
    assert r.status == "completed" and r.termination_reason in (TR.ENV_DONE, TR.RESPONSE_TRUNCATION), r.error
    [traj] = r.trajectories
    assert len(traj.steps) == 3 and traj.info["tool_call_errors"] == 6


async def test_multi_turn_frozenlake_token_assembly(stack, model_path, redis):
    config = run_config(model_path, agent={"name": "frozenlake"}, env={"name": "frozenlake"}, max_steps=3,
                        max_response_tokens=6, max_prompt_tokens=1024)
    run_id = insert_run(stack["database_url"], config)
    rows = [{**r, "map": ["SFFF", "FFFF", "FFFF", "FFFG"]} for r in generate("frozenlake", 2, seed=0)]
    await publish_tasks(redis, [make_task(run_id, row) for row in rows])
    for r in await collect_results(redis, run_id, expected=2):
        assert r.status == "completed", r.error
        traj = r.trajectories[0]
        check_tokens(r)
        assert len(traj.steps) == 3 and r.termination_reason in (TR.MAX_STEPS, TR.RESPONSE_TRUNCATION)
        assert not traj.mismatch and 0 in traj.loss_mask  # observation tokens between the turns
        generated = sum(len(s.response_ids) for s in traj.steps)
        assert sum(traj.loss_mask) == generated


async def test_solver_judge_workflow(stack, model_path, redis):
    config = run_config(model_path, workflow={"name": "solver_judge", "args": {"num_solutions": 2}})
    run_id = insert_run(stack["database_url"], config)
    await publish_tasks(redis, [make_task(run_id, generate("arithmetic", 1, seed=2)[0])])
    [r] = await collect_results(redis, run_id, expected=1)
    assert r.status == "completed", r.error
    assert [t.name for t in r.trajectories] == ["solver", "solver", "judge"]
    assert "Candidate 1" in r.trajectories[2].steps[0].chat_completions[0]["content"]
    assert set(r.metrics) >= {"solver_acc", "judge_acc", "num_trajectories"}


async def test_lost_env_session_is_infra_failure(stack, model_path, redis, redis_url):
    """The env worker dies between reset and step: the episode is `failed` with INFRA_ERROR, not a reward-0."""
    config = run_config(model_path, env={"name": "fw_user_plugins:SlowEnv"}, env_step_timeout_s=1)
    run_id = insert_run(stack["database_url"], config)
    doomed = start_service("services.env_worker.main", redis_url=redis_url, worker_id="env-doomed")
    wait_heartbeat(redis_url, "env-worker", "env-doomed", doomed)
    # SlowEnv sleeps 30 s in step: whoever owns the session times out (timeout) or dies (lost)
    await publish_tasks(redis, [make_task(run_id, {"id": f"slow{i}", "sleep_s": 30}) for i in range(2)])
    time.sleep(3)
    doomed.kill()
    doomed.wait()
    results = await collect_results(redis, run_id, expected=2, timeout_s=60)
    by_owner = {r.termination_reason for r in results}
    assert by_owner <= {TR.ENV_TIMEOUT, TR.INFRA_ERROR}
    for r in results:
        if r.termination_reason == TR.INFRA_ERROR:
            assert r.status == "failed" and r.trajectories == []
        else:  # the live env worker's step ran past env_step_timeout_s: the user's env hung
            assert r.status == "error" and r.error.startswith("env fw_user_plugins:SlowEnv.step: ")


async def test_a_task_past_its_lease_is_not_run(stack, model_path, redis):
    """An attempt that waited in `rollout.tasks` past its ledger lease (the controller has re-dispatched it) is
    acked unrun: no EpisodeResult, counted in rollout_tasks_expired_total. The live task behind it runs."""
    run_id = insert_run(stack["database_url"], run_config(model_path))
    expired, live = (make_task(run_id, row) for row in generate("arithmetic", 2, seed=3))
    expired.lease_expires_at, live.lease_expires_at = time.time() - 1, time.time() + 120
    port = json.loads(await redis.get("heartbeat:rollout-worker:rollout-1"))["port"]

    def expired_count() -> float:
        text = httpx.get(f"http://127.0.0.1:{port}/metrics").text
        return next(float(line.split()[1]) for line in text.splitlines()
                    if line.startswith('rollout_tasks_expired_total{when="read"}'))

    before = expired_count()
    expired_id, _ = await publish_tasks(redis, [expired, live])
    [r] = await collect_results(redis, run_id, expected=1, timeout_s=60)
    assert r.task_id == live.task_id and r.status == "completed", r.error
    # read no later than the live task (an earlier entry) and acked at once, long before its generation ends
    assert expired_count() == before + 1
    assert await redis.xpending_range("rollout.tasks", "rollout", min=expired_id, max=expired_id, count=1) == []
    entries = await redis.xrange("trajectories")
    assert not [f for _, f in entries if decode(f, EpisodeResult).key[:2] == (run_id, expired.task_id)]


async def test_an_agent_that_drops_old_turns_is_trained_one_sequence_per_context(stack, model_path, redis):
    """A sliding-window agent (keep_last_turns=1: each turn's prompt is the system prompt + the newest
    observation) rewrites its history every turn: the episode arrives as one trajectory per context, in order,
    each token-exact and trained (mask not zero), the last counting the rewrites."""
    config = run_config(model_path, agent={"name": "frozenlake", "args": {"keep_last_turns": 1}},
                        env={"name": "frozenlake"}, max_steps=3, max_response_tokens=6, max_prompt_tokens=1024)
    run_id = insert_run(stack["database_url"], config)
    rows = [{**r, "map": ["SFFF", "FFFF", "FFFF", "FFFG"]} for r in generate("frozenlake", 2, seed=0)]
    await publish_tasks(redis, [make_task(run_id, row) for row in rows])
    for r in await collect_results(redis, run_id, expected=2):
        assert r.status == "completed" and r.termination_reason in (TR.MAX_STEPS, TR.RESPONSE_TRUNCATION), r.error
        check_tokens(r)
        assert len(r.trajectories) == 3 and all(len(t.steps) == 1 for t in r.trajectories)
        for k, traj in enumerate(r.trajectories):
            [step] = traj.steps
            assert traj.info["sequence"] == k and traj.info["sequences"] == 3 and traj.info["first_turn"] == k
            assert traj.reward == r.reward
            assert not traj.mismatch and sum(traj.loss_mask) == len(step.response_ids) > 0
            assert traj.prompt_ids + traj.response_ids == step.prompt_ids + step.response_ids  # token-exact
            assert [m["role"] for m in step.chat_completions[:2]] == ["system", "user"]
        assert [t.info.get("context_rewrites") for t in r.trajectories] == [None, None, 2]
