"""Managed agent programs end to end: a real rollout-worker process (HF engine, tiny model) runs the user's
openai-SDK program per task in its own process, through its gateway; the EpisodeResults go to `trajectories`
and into Postgres through the store like every other rollout."""

from __future__ import annotations

import asyncio
import json
import math
import shutil
import urllib.request
import uuid

import pytest
import torch
from fixtures.rollout_stack import collect_results, insert_run, make_task, publish_tasks, run_config
from sqlalchemy import insert, text
from trainer_testlib import WeightServer

from services.controller.store import TrajectoryStore
from shared.contracts.db.models import RolloutTaskRow
from shared.platform.bus import connect
from shared.platform.db.session import make_engine
from shared.sdk.types import TerminationReason as TR
from tests.support.procs import start_service, stop, wait_heartbeat, wait_until
from tests.support.runners import Runners
from tests.support.tiny_model import build_tiny_model


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return str(build_tiny_model(tmp_path_factory.mktemp("tiny") / "model", seed=0))


@pytest.fixture(scope="module")
def worker(redis_url, database_url, tmp_path_factory):
    proc = start_service("services.rollout_worker.main", redis_url=redis_url, database_url=database_url,
                         worker_id="rollout-gw", data_dir=str(tmp_path_factory.mktemp("data")), max_concurrency="8")
    try:
        health = wait_heartbeat(redis_url, "rollout-worker", "rollout-gw", proc)
        yield {"proc": proc, "health": health, "database_url": database_url}
    finally:
        print(stop(proc)[-5000:])


@pytest.fixture
async def redis(redis_url):
    client = connect(redis_url)
    yield client
    await client.aclose()


async def run_program(worker, redis, model_path, program, n=1, **overrides):
    config = run_config(model_path, agent_program={"name": f"fw_agent_programs:{program}"},
                        max_response_tokens=8, **overrides)
    run_id = insert_run(worker["database_url"], config)
    tasks = [make_task(run_id, {"id": f"{program}-{i}", "question": "What is 2 + 2?"}) for i in range(n)]
    await publish_tasks(redis, tasks)
    return run_id, await collect_results(redis, run_id, expected=n, timeout_s=180)


def check_tokens(traj):
    assert len(traj.response_ids) == len(traj.loss_mask) == len(traj.logprobs) == len(traj.versions)
    assert all(math.isfinite(x) and x <= 0 for x in traj.logprobs) and not traj.mismatch
    assert sum(traj.loss_mask) == sum(len(s.response_ids) for s in traj.steps)
    assert all(s.weight_version == 0 for s in traj.steps)


async def test_program_through_gateway_is_a_stored_episode(worker, redis, model_path):
    run_id, results = await run_program(worker, redis, model_path, "answer", n=2)
    for r in results:
        assert r.status == "completed" and r.termination_reason == TR.ENV_DONE, r.error
        [traj] = r.trajectories
        assert traj.name == "policy" and len(traj.steps) == 1 and r.reward == traj.reward
        assert r.info["fp"] == "flywheel-v0" and r.info["mismatches"] == 0
        check_tokens(traj)
    engine = make_engine(worker["database_url"])
    try:
        with engine.begin() as c:  # what the controller's ledger holds for dispatched tasks
            c.execute(insert(RolloutTaskRow), [
                dict(run_id=uuid.UUID(run_id), task_id=r.task_id, sample_idx=0, attempt=0, status="dispatched",
                     batch_idx=0, epoch=0, greedy=False, dispatch_version=0) for r in results])
        assert TrajectoryStore(engine).write(results).stored == 2  # the same tables as any rollout
        with engine.connect() as c:
            n = c.execute(text("SELECT count(*) FROM trajectories WHERE run_id = :r"), {"r": run_id}).scalar_one()
            status = c.execute(text("SELECT DISTINCT status FROM rollout_tasks WHERE run_id = :r"),
                               {"r": run_id}).scalars().all()
        assert n == 2 and status == ["completed"]
    finally:
        engine.dispose()


async def test_lora_runs_programs_go_through_the_gateway(worker, redis, model_path):
    """Agent programs of LoRA runs go through the gateway: two runs at once, no adapter published yet (version
    0), every token tagged and logprobbed as for a full-weight run."""
    lora = {"lora": {"rank": 4, "target_modules": ["q_proj", "v_proj"]}}
    (_, first), (_, second) = await asyncio.gather(
        run_program(worker, redis, model_path, "answer", n=2, algorithm=lora),
        run_program(worker, redis, model_path, "answer", n=2, algorithm=lora))
    for r in first + second:
        assert r.status == "completed" and r.termination_reason == TR.ENV_DONE, r.error
        [traj] = r.trajectories
        check_tokens(traj)


async def test_a_lora_runs_program_is_served_its_published_adapter(worker, redis, model_path, redis_url, database_url,
                                                                   tmp_path):
    """A LoRA run's program before and after its first adapter version is published through a real weight
    server: after, every token is tagged version 1 and its logprob is the adapter's (PEFT, teacher-forced),
    not the base's."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from services.trainer.publisher import WeightPublisher
    from shared.weights.manifest import BaseModelRef, base_model_digest
    from tests.support.tiny_model import random_lora_adapter

    server = WeightServer(redis_url, database_url, tmp_path / "weights", ANNOUNCE_PATH="false").start()
    try:
        config = run_config(model_path, agent_program={"name": "fw_agent_programs:answer"}, max_response_tokens=8,
                            algorithm={"lora": {"rank": 8, "alpha": 16, "target_modules": "all-linear"}})
        run_id = insert_run(worker["database_url"], config)

        async def answers(round_: int) -> list:
            tasks = [make_task(run_id, {"id": f"r{round_}-{i}", "question": "What is 2 + 2?"}) for i in range(2)]
            await publish_tasks(redis, tasks)
            got = await collect_results(redis, run_id, expected=2 * (round_ + 1), timeout_s=180)
            return [r for r in got if r.task_id.startswith(f"r{round_}-")]

        before = await answers(0)
        assert all(s.weight_version == 0 for r in before for s in r.trajectories[0].steps)
        random_lora_adapter(model_path, tmp_path / "adapter", seed=3, rank=8)
        shutil.copytree(tmp_path / "adapter", tmp_path / "staging")  # the publisher consumes the folder it sends
        WeightPublisher(server.url, None, timeout_s=60).publish(
            run_id, 1, tmp_path / "staging", {}, base_model=BaseModelRef(name=model_path, sha256=base_model_digest(model_path)))
        metrics = f"http://127.0.0.1:{worker['health']['port']}/metrics"
        wait_until(lambda: f'rollout_weight_version{{run_id="{run_id}"}} 1.0' in urllib.request.urlopen(metrics).read().decode(),
                   60, "the worker to serve adapter v1", procs=[worker["proc"]])
        after = await answers(1)
        base = AutoModelForCausalLM.from_pretrained(model_path).eval()
        adapted = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(model_path), str(tmp_path / "adapter")).eval()
        for r in after:
            assert r.status == "completed", r.error
            [traj] = r.trajectories
            [step] = traj.steps
            assert step.weight_version == 1 and set(traj.versions) == {1}
            ids = torch.tensor([step.prompt_ids + step.response_ids])
            n = len(step.response_ids)
            with torch.no_grad():
                lp = {name: torch.log_softmax(m(ids).logits[0, -n - 1:-1].float(), -1)
                      .gather(1, ids[0, -n:, None])[:, 0] for name, m in (("base", base), ("adapter", adapted))}
            served = torch.tensor(step.logprobs)
            assert torch.allclose(served, lp["adapter"], atol=1e-4), (served, lp)
            assert not torch.allclose(served, lp["base"], atol=1e-3)
    finally:
        server.stop()


async def test_unmodified_sdk_program_with_tools_and_streaming(worker, redis, model_path):
    _, [r] = await run_program(worker, redis, model_path, "unmodified")
    assert r.status == "completed" and r.termination_reason == TR.ENV_DONE, r.error
    [traj] = r.trajectories
    assert len(traj.steps) == 2 and r.reward == 0.25 and r.info["mismatches"] == 0
    check_tokens(traj)
    s1, s2 = traj.steps
    assert s2.prompt_ids[: len(s1.prompt_ids) + len(s1.response_ids)] == s1.prompt_ids + s1.response_ids


async def test_multi_agent_program_is_one_episode_of_several_trajectories(worker, redis, model_path):
    _, [r] = await run_program(worker, redis, model_path, "solver_judge")
    assert r.status == "completed" and r.is_correct, r.error
    assert [(t.name, t.reward) for t in r.trajectories] == [("solver", 1.0), ("judge", 0.5)]


async def test_edited_history_is_detected_and_counted(worker, redis, model_path):
    _, [r] = await run_program(worker, redis, model_path, "edits_history")
    assert r.status == "completed" and r.info["mismatches"] == 1 and r.metrics["mismatches"] == 1
    assert len(r.trajectories) == 2 and r.trajectories[1].info["split_by_mismatch"]
    for traj in r.trajectories:
        check_tokens(traj)


@pytest.mark.parametrize(("program", "reason", "needle"), [
    ("crashes", TR.ERROR, "the agent program broke"),
    ("exits", TR.ERROR, "exit code 3"),
    ("bad_return", TR.ERROR, "return a number"),
    ("memory_hog", TR.ERROR, "MemoryError"),
    ("hangs", TR.TIMEOUT, "did not finish within"),
])
async def test_failing_programs_are_recorded_and_the_worker_lives(worker, redis, model_path, program, reason,
                                                                  needle):
    # Only `hangs` needs the limit to fire; the others get room for a slow interpreter start on a busy machine.
    _, [r] = await run_program(worker, redis, model_path, program,
                               trajectory_timeout_s=15 if program == "hangs" else 60)
    # A program that fails is the user's code failing: an `error` outcome saying where (never a scored 0); one
    # that runs out of time is a scored TIMEOUT.
    assert r.status == ("completed" if reason == TR.TIMEOUT else "error") and r.termination_reason == reason
    assert needle in r.error and r.reward == 0.0
    if r.status == "error":
        assert r.error.startswith(f"agent program fw_agent_programs:{program}: "), r.error
    if program in ("crashes", "hangs"):  # the call made before failing is kept (masked as ERROR/TIMEOUT)
        assert len(r.trajectories) == 1 and r.trajectories[0].termination_reason == reason
    assert worker["proc"].poll() is None
    health = json.load(urllib.request.urlopen(f"http://127.0.0.1:{worker['health']['port']}/healthz"))
    assert health["gateway_port"] > 0
    _, [after] = await run_program(worker, redis, model_path, "answer")  # and still serves
    assert after.status == "completed" and after.termination_reason == TR.ENV_DONE


async def claim(worker, run_id: str, wait_s: float = 30.0) -> dict | None:
    import aiohttp

    url = f"http://127.0.0.1:{worker['health']['gateway_port']}/v1/runs/{run_id}/sessions"
    async with aiohttp.ClientSession() as http, http.post(url, json={"wait_s": wait_s}) as resp:
        return await resp.json() if resp.status == 200 else None


async def test_external_program_claims_a_session_and_posts_its_reward(worker, redis, model_path):
    import openai

    config = run_config(model_path, agent_program={"name": "external"}, max_response_tokens=8)
    run_id = insert_run(worker["database_url"], config)
    await publish_tasks(redis, [make_task(run_id, {"id": "ext-0", "question": "2 + 2?"})])
    session = await claim(worker, run_id)
    assert session["task"]["question"] == "2 + 2?" and session["task_id"] == "ext-0"
    client = openai.AsyncOpenAI(base_url=session["base_url"], api_key="unused", max_retries=0)
    await client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "2 + 2?"}])
    posted = await client.post("/reward", body={"reward": 0.75, "info": {"by": "external"}}, cast_to=dict)
    assert posted["calls"] == 1
    [r] = await collect_results(redis, run_id, expected=1)
    assert r.status == "completed" and r.termination_reason == TR.ENV_DONE and r.reward == 0.75
    assert r.info["by"] == "external" and len(r.trajectories[0].steps) == 1
    with pytest.raises(openai.NotFoundError):  # the session is over
        await client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "again"}])


async def test_external_sessions_that_never_report_time_out_as_failures(worker, redis, model_path):
    config = run_config(model_path, agent_program={"name": "external"}, trajectory_timeout_s=4)
    run_id = insert_run(worker["database_url"], config)
    await publish_tasks(redis, [make_task(run_id, {"id": f"silent-{i}", "question": "?"}) for i in range(2)])
    assert await claim(worker, run_id) is not None  # claimed, then the runner goes silent; the other is never claimed
    results = await collect_results(redis, run_id, expected=2)
    errors = sorted(r.error for r in results)
    assert all(r.termination_reason == TR.TIMEOUT for r in results)
    assert "claimed but no reward" in errors[0] and "never claimed" in errors[1]
    assert await claim(worker, run_id, wait_s=0.2) is None  # nothing left waiting


async def answer_two(task: dict, client) -> float:
    """An external runner's agent: plain OpenAI SDK code against the session's base URL."""
    reply = await client.chat.completions.create(
        model="policy", max_tokens=1, messages=[{"role": "user", "content": task["question"]}])
    return float((reply.choices[0].message.content or "").strip() == task["answer"])


async def test_a_runner_fleet_larger_than_a_connection_pool_gets_every_reward_through(worker, redis, model_path):
    """128 external runners (more than aiohttp's default pool of 100) long-poll one worker for sessions: each
    claimed session still gets its call and its reward through, none times out. Regression: `make demo-agent`'s
    runners shared one capped pool between claims and reward posts; the claims' long polls took every connection,
    every session timed out, and the run never trained."""
    config = run_config(model_path, agent_program={"name": "external"}, max_response_tokens=1,
                        trajectory_timeout_s=15)
    run_id = insert_run(worker["database_url"], config)
    n = 24  # three rounds of the worker's 8 slots
    await publish_tasks(redis, [make_task(run_id, {"id": f"fleet-{i}", "question": "two", "answer": "2"})
                                for i in range(n)])
    runners = Runners(f"http://127.0.0.1:{worker['health']['gateway_port']}/v1/runs/{run_id}/sessions",
                      answer_two, concurrency=128)
    thread = runners.start()
    try:
        results = await collect_results(redis, run_id, expected=n, timeout_s=90)
    finally:
        runners.stop.set()
        thread.join(10)
    assert [r.termination_reason for r in results] == [TR.ENV_DONE] * n, {r.error for r in results}
    assert all(len(r.trajectories[0].steps) == 1 for r in results)
    assert runners.episodes == n and runners.failures == 0 and runners.versions == {0}


async def test_runners_claim_sessions_through_the_api(worker, redis, redis_url, model_path, tmp_path):
    """`POST /v1/runs/{id}/sessions` on the API (bearer API token) hands out the sessions waiting at the workers
    (found through their heartbeats); the runners then talk to the worker directly."""
    import httpx
    from api_testlib import start_api

    db = worker["database_url"]
    run_id = insert_run(db, run_config(model_path, agent_program={"name": "external"}, max_response_tokens=1,
                                       trajectory_timeout_s=30))
    managed = insert_run(db, run_config(model_path, agent_program={"name": "fw_agent_programs:answer"}))
    api = start_api(db, redis_url, tmp_path, controller=False)
    try:
        with api.client() as c:
            url = f"/v1/runs/{run_id}/sessions"
            assert c.post(url, json={"wait_s": 0.3}).status_code == 204  # nothing dispatched yet
            assert c.post(f"/v1/runs/{managed}/sessions", json={}).status_code == 400
            assert c.post(f"/v1/runs/{uuid.uuid4()}/sessions", json={}).status_code == 404
            assert httpx.post(api.url + url, json={}).status_code == 401
        # More waiting runners than the API's database pool (15): a long poll must not hold a connection.
        runners = Runners(api.url + url, answer_two, concurrency=32, headers={"Authorization": f"Bearer {api.token}"})
        thread = runners.start()
        try:
            await asyncio.sleep(3)
            with api.client() as c:  # other routes answer while the claims wait
                assert c.get(f"/v1/runs/{run_id}", timeout=10).status_code == 200
            n = 6
            await publish_tasks(redis, [make_task(run_id, {"id": f"api-{i}", "question": "two", "answer": "2"})
                                        for i in range(n)])
            results = await collect_results(redis, run_id, expected=n, timeout_s=90)
        finally:
            runners.stop.set()
            thread.join(10)
    finally:
        api.stop()
    assert [r.termination_reason for r in results] == [TR.ENV_DONE] * n, {r.error for r in results}
    assert runners.episodes == n and runners.failures == 0
