"""A user's journey over HTTP with the real controller: create a dataset, start an evaluation run, watch it
complete, query its trajectories over REST and with the documented SQL, stop a training run and see it stopped.

The rollout data plane is played by this test (it takes tasks from `rollout.tasks` and answers with
EpisodeResult messages on `trajectories`, as a rollout worker would), so the controller's real dispatch,
storage and completion logic runs without a model.

    pytest -q tests/e2e/test_api_journey.py
"""

from __future__ import annotations

import json
import threading
import time

import pytest
from api_testlib import run_config, service_env, start_api
from fixtures.fake_rollouts import serve_rollout_tasks

import services.controller.main  # noqa: F401  (a controller that cannot import fails here, not as a timeout)
from shared.contracts.messages.rollout import RolloutTask
from shared.contracts.messages.trajectory import EpisodeResult, TrajectoryRecord, TrajectoryStep
from tests.support.procs import start_service, stop, wait_until


@pytest.fixture(scope="module")
def stack(isolated_urls, tmp_path_factory):
    redis_url, database_url = isolated_urls  # its controller would otherwise resume earlier modules' runs
    data = tmp_path_factory.mktemp("journey")
    api = start_api(database_url, redis_url, data, controller=False, jobs=True, SQL_TIMEOUT_S="0.5")
    controller = start_service("services.controller.main", log=data / "controller.log",
                               **service_env(database_url, redis_url, data, STOP_TIMEOUT_S="1", POLL_INTERVAL_S="0.2"))
    yield api
    stop(controller)
    api.stop()


def answer(task: RolloutTask) -> EpisodeResult:
    correct = task.sample_idx % 2 == 0
    reply = f"The answer is \\boxed{{{task.task.get('answer') if correct else 'wrong'}}}"
    step = TrajectoryStep(prompt_ids=[1, 2], response_ids=[3, 4, 5], logprobs=[-0.1, -0.2, -0.3],
                      chat_completions=[{"role": "user", "content": task.task["question"]},
                                        {"role": "assistant", "content": reply}],
                      model_response=reply, reward=float(correct), done=True, weight_version=0)
    traj = TrajectoryRecord(uid=f"{task.task_id}-{task.sample_idx}", name="solver", reward=float(correct),
                            termination_reason="env_done", steps=[step], prompt_ids=[1, 2],
                            response_ids=[3, 4, 5], loss_mask=[1, 1, 1], logprobs=[-0.1, -0.2, -0.3],
                            versions=[0, 0, 0])
    now = time.time()
    return EpisodeResult(run_id=task.run_id, task_id=task.task_id, sample_idx=task.sample_idx,
                         attempt=task.attempt, status="completed", termination_reason="env_done",
                         is_correct=correct, reward=float(correct), task=task.task, trajectories=[traj],
                         worker_id="fake-worker", batch_idx=task.batch_idx, started_at=now - 0.1, finished_at=now)


def test_user_journey(stack, redis_url):
    with stack.client() as api:
        rows = [{"id": f"j{i}", "question": f"{i}+1?", "answer": str(i + 1)} for i in range(3)]
        r = api.post("/v1/datasets", data={"name": "journey"},
                     files={"file": ("journey.jsonl", "\n".join(json.dumps(x) for x in rows).encode())})
        assert r.status_code == 201

        # An evaluation run: 3 tasks x 4 samples, watched until the controller completes it.
        r = api.post("/v1/runs", json=run_config("journey", name="journey-eval", kind="eval", samples_per_task=4))
        assert r.status_code == 201, r.text
        eval_id = r.json()["id"]
        stop_worker = threading.Event()
        worker = threading.Thread(target=serve_rollout_tasks, daemon=True, args=(
            redis_url, stop_worker, lambda t: answer(t) if t.run_id == eval_id else None))
        worker.start()
        try:
            run = wait_until(lambda: (x := api.get(f"/v1/runs/{eval_id}").json())["status"] in
                             ("completed", "failed") and x, 60, "the evaluation run to end")
        finally:
            stop_worker.set()
            worker.join(5)
        assert run["status"] == "completed", run
        assert run["progress"]["done"] == 12 and run["progress"]["fraction"] == 1.0
        assert run["pass_at_k"]["pass@1"] == pytest.approx(0.5) and run["pass_at_k"]["pass@4"] == 1.0

        # Its trajectories over REST ...
        page = api.get(f"/v1/runs/{eval_id}/trajectories", params={"min_reward": 1, "limit": 100}).json()
        assert page["count"] == 6
        detail = api.get(f"/v1/trajectories/{page['data'][0]['id']}").json()
        assert detail["steps"][0]["chat_completions"][1]["role"] == "assistant"

        # ... and with the documented SQL (as the read-only role, through the API).
        q = f"SELECT task_id, num_samples, pass_rate FROM task_pass_rate WHERE run_id = '{eval_id}' ORDER BY task_id"
        out = api.post("/v1/sql", json={"query": q}).json()
        assert out["rows"] == [["j0", 4, 0.5], ["j1", 4, 0.5], ["j2", 4, 0.5]]
        slow = api.post("/v1/sql", json={"query": "SELECT pg_sleep(3)"})
        assert slow.status_code == 400 and "timeout" in slow.json()["message"]

        # A training run (no rollout worker answers it): started, then stopped by the user.
        train_id = api.post("/v1/runs", json=run_config("journey", name="journey-train", total_steps=100)).json()["id"]
        wait_until(lambda: api.get(f"/v1/runs/{train_id}").json()["status"] == "running", 30, "the run to start")
        # the reply comes once the controller has applied the stop: stopping, or already stopped when it found
        # nothing in flight to wait for
        assert api.post(f"/v1/runs/{train_id}/stop").json()["status"] in ("stopping", "stopped")
        stopped = wait_until(lambda: (x := api.get(f"/v1/runs/{train_id}").json())["status"] == "stopped" and x, 30,
                             "the run to stop")
        units, attempts = stopped["ledger"]["units"], stopped["ledger"]["attempts"]
        assert units["in_flight"] == attempts["in_flight"] == 0 and units["cancelled"] > 0  # a stopped run adds up
        assert sum(v for k, v in units.items() if k != "total") == units["total"] > 0
        assert sum(v for k, v in attempts.items() if k != "total") == attempts["total"] >= units["total"]
        assert api.post(f"/v1/runs/{train_id}/resume").status_code == 409
