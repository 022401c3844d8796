"""env-worker over real Redis, as a real process: sticky sessions, user exceptions, idle expiry, timeouts."""

from __future__ import annotations

import asyncio
import time
import uuid

import httpx
import pytest

from shared.contracts.messages import EnvReply, EnvRequest, decode, encode
from shared.contracts.streams import ENV_REQUESTS, dead_letter, env_inbox
from tests.support.procs import start_service, stop, wait_heartbeat

REPLIES = "env.replies.test"


@pytest.fixture
def env_workers(redis_url):
    procs: dict[str, object] = {}

    def start(worker_id: str, **env):
        proc = start_service("services.env_worker.main", redis_url=redis_url, worker_id=worker_id,
                             sweep_interval_s="0.2", reclaim_interval_s="0.5", **env)
        procs[worker_id] = proc
        return wait_heartbeat(redis_url, "env-worker", worker_id, proc)

    yield start
    for proc in procs.values():
        stop(proc)


class Client:
    def __init__(self, redis):
        self.redis, self.cursor = redis, "$"

    async def call(self, stream: str, op: str, session: str, *, env: str = "math", timeout_s: float = 10.0,
                   ttl_s: float = 900.0, **fields) -> EnvReply:
        if self.cursor == "$":
            self.cursor = (await self.redis.xinfo_stream(REPLIES))["last-generated-id"] \
                if await self.redis.exists(REPLIES) else "0-0"
        req = EnvRequest(request_id=uuid.uuid4().hex, op=op, session_id=session, run_id="r1", env=env,
                         reply_to=REPLIES, timeout_s=timeout_s, session_ttl_s=ttl_s, sent_at=time.time(), **fields)
        await self.redis.xadd(stream, encode(req))
        deadline = time.monotonic() + timeout_s + 20
        while time.monotonic() < deadline:
            resp = await self.redis.xread({REPLIES: self.cursor}, block=1000, count=10)
            for _, entries in resp or []:
                for eid, data in entries:
                    self.cursor = eid
                    reply = decode(data, EnvReply)
                    if reply.request_id == req.request_id:
                        return reply
        raise TimeoutError(f"no reply to {op}")


MATH_TASK = {"question": "What is 2 + 2?", "ground_truth": "4"}


async def test_sticky_sessions_across_two_workers(env_workers, redis_client):
    env_workers("env-a")
    env_workers("env-b")
    client = Client(redis_client)
    owners = {}
    for i in range(6):
        reply = await client.call(ENV_REQUESTS, "reset", f"s{i}", env="fw_user_plugins:PidMathEnv", task=MATH_TASK)
        assert reply.ok and reply.observation["question"] == MATH_TASK["question"]
        owners[f"s{i}"] = (reply.env_worker_id, reply.info["env_pid"])
    assert {o[0] for o in owners.values()} <= {"env-a", "env-b"}
    for sid, (owner, _) in owners.items():
        reply = await client.call(env_inbox(owner), "step", sid, action="so \\boxed{4}")
        assert reply.ok and reply.reward == 1.0 and reply.done and reply.env_worker_id == owner
    # a step sent to the worker that does not own the session: session_lost, not a crash
    sid, (owner, _) = next(iter(owners.items()))
    other = "env-b" if owner == "env-a" else "env-a"
    reply = await client.call(env_inbox(other), "step", sid, action="x")
    assert not reply.ok and reply.error_kind == "session_lost"
    reply = await client.call(env_inbox(owner), "close", sid)
    assert reply.ok
    reply = await client.call(env_inbox(owner), "step", sid, action="x")
    assert reply.error_kind == "session_lost"


async def test_user_exception_is_an_error_reply_and_worker_lives(env_workers, redis_client):
    env_workers("env-err")
    client = Client(redis_client)
    reply = await client.call(ENV_REQUESTS, "reset", "c1", env="fw_user_plugins:CrashingEnv", task={})
    assert reply.ok
    reply = await client.call(env_inbox("env-err"), "step", "c1", env="fw_user_plugins:CrashingEnv", action="a")
    assert not reply.ok and reply.error_kind == "user" and "ZeroDivisionError" in reply.error
    reply = await client.call(ENV_REQUESTS, "reset", "c2", env="fw_user_plugins:CrashingEnv",
                              task={"crash_on_reset": True})
    assert reply.error_kind == "user" and "exploded in reset" in reply.error
    reply = await client.call(ENV_REQUESTS, "reset", "c3", env="no_such_pkg.mod:Env", task={})
    assert reply.error_kind == "bad_request" and "cannot import" in reply.error
    await redis_client.xadd(env_inbox("env-err"), {b"garbage": b"1"})
    reply = await client.call(ENV_REQUESTS, "reset", "c4", task=MATH_TASK)
    assert reply.ok  # still serving
    for _ in range(50):
        if await redis_client.xlen(dead_letter(env_inbox("env-err"))):
            break
        await asyncio.sleep(0.1)
    assert await redis_client.xlen(dead_letter(env_inbox("env-err"))) == 1


async def test_final_reward_is_reported_on_done(env_workers, redis_client):
    env_workers("env-final")
    client = Client(redis_client)
    env = "fw_user_plugins:FinalRewardEnv"
    assert (await client.call(ENV_REQUESTS, "reset", "f1", env=env, task={})).ok
    first = await client.call(env_inbox("env-final"), "step", "f1", env=env, action="a")
    assert not first.done and first.final_reward is None
    second = await client.call(env_inbox("env-final"), "step", "f1", env=env, action="a")
    assert second.done and second.final_reward == 0.75


async def test_done_step_closes_the_session_and_replyless_close_sends_nothing(env_workers, redis_client, tmp_path):
    env_workers("env-close")
    client = Client(redis_client)
    env, log = "fw_user_plugins:CloseRecordingEnv", tmp_path / "closed.log"
    for sid in ("d1", "d2"):
        assert (await client.call(ENV_REQUESTS, "reset", sid, env=env,
                                  task={"closed_log": str(log), "marker": sid})).ok
    first = await client.call(env_inbox("env-close"), "step", "d1", env=env, action="a")
    assert not first.done and not first.closed
    done = await client.call(env_inbox("env-close"), "step", "d1", env=env, action="a")
    assert done.done and done.closed and done.final_reward == 0.75
    assert log.read_text().split() == ["d1"]  # closed with the done step: no close request needed
    again = await client.call(env_inbox("env-close"), "step", "d1", env=env, action="a")
    assert again.error_kind == "session_lost"

    # a close that asks for no reply (reply_to ""): the session is closed and nothing is written back
    replies_before = await redis_client.xlen(REPLIES)
    req = EnvRequest(request_id=uuid.uuid4().hex, op="close", session_id="d2", run_id="r1", env=env, reply_to="",
                     sent_at=time.time())
    await redis_client.xadd(env_inbox("env-close"), encode(req))
    for _ in range(100):  # the env closes in a thread; the ack follows once the handler returns
        pending = (await redis_client.xpending(env_inbox("env-close"), "env"))["pending"]
        if log.read_text().split() == ["d1", "d2"] and pending == 0:
            break
        await asyncio.sleep(0.05)
    assert log.read_text().split() == ["d1", "d2"]
    assert pending == 0  # acknowledged
    assert await redis_client.xlen(REPLIES) == replies_before


async def test_idle_session_expires_and_is_counted(env_workers, redis_client):
    health = env_workers("env-ttl")
    client = Client(redis_client)
    assert (await client.call(ENV_REQUESTS, "reset", "t1", task=MATH_TASK, ttl_s=0.5)).ok
    await asyncio.sleep(1.5)
    reply = await client.call(env_inbox("env-ttl"), "step", "t1", action="\\boxed{4}")
    assert reply.error_kind == "session_lost"
    metrics = httpx.get(f"http://127.0.0.1:{health['port']}/metrics").text
    assert "env_sessions_expired_total 1.0" in metrics


async def test_env_call_timeout(env_workers, redis_client):
    env_workers("env-slow")
    client = Client(redis_client)
    env = "fw_user_plugins:SlowEnv"
    assert (await client.call(ENV_REQUESTS, "reset", "w1", env=env, task={"sleep_s": 3})).ok
    reply = await client.call(env_inbox("env-slow"), "step", "w1", env=env, action="a", timeout_s=0.5)
    assert reply.error_kind == "timeout" and "exceeded 0.5s" in reply.error
    assert (await client.call(ENV_REQUESTS, "reset", "w2", task=MATH_TASK)).ok  # still serving


def test_config_is_logged_once_at_start_with_secrets_masked(redis_url):
    db_url = "postgresql://flywheel:pg-secret-5d2e@127.0.0.1:5432/flywheel"  # env-worker never connects to it
    proc = start_service("services.env_worker.main", redis_url=redis_url, worker_id="env-cfg", database_url=db_url)
    wait_heartbeat(redis_url, "env-worker", "env-cfg", proc)
    out = stop(proc)
    logged = [line for line in out.splitlines() if "env-worker config: {" in line]
    assert len(logged) == 1, out
    assert "'database_url': 'postgresql+psycopg://flywheel:***@127.0.0.1:5432/flywheel'" in logged[0]
    assert "'worker_id': 'env-cfg'" in logged[0] and "pg-secret-5d2e" not in out
