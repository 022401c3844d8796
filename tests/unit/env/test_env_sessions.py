"""SessionHost without Redis: the reply kinds for each failure, and idle expiry."""

import time

from services.env_worker.sessions import SessionHost
from shared.contracts.messages import EnvRequest


def request(op: str, session: str = "s", env: str = "math", **kw) -> EnvRequest:
    return EnvRequest(request_id="r", op=op, session_id=session, run_id="run", env=env, reply_to="x",
                      sent_at=time.time(), **kw)


async def test_reset_step_close_roundtrip():
    host = SessionHost("w", threads=2, max_sessions=10)
    reply = await host.handle(request("reset", task={"question": "1+1?", "ground_truth": "2"}))
    assert reply.ok and reply.observation["question"] == "1+1?"
    reply = await host.handle(request("step", action="\\boxed{2}"))
    assert reply.ok and reply.reward == 1.0 and reply.done and reply.final_reward is None
    assert (await host.handle(request("close"))).ok and not host.sessions


async def test_error_kinds():
    host = SessionHost("w", threads=2, max_sessions=1)
    assert (await host.handle(request("step", action="x"))).error_kind == "session_lost"
    assert (await host.handle(request("reset", env="nope"))).error_kind == "bad_request"
    reply = await host.handle(request("reset", task={"question": "no reference"}))
    assert reply.error_kind == "user" and "ground_truth" in reply.error
    await host.handle(request("reset", session="a", task={"question": "q", "ground_truth": "1"}))
    reply = await host.handle(request("reset", session="b", task={"question": "q", "ground_truth": "1"}))
    assert reply.error_kind == "session_lost" and "maximum" in reply.error


async def test_idle_sessions_expire():
    host = SessionHost("w", threads=2, max_sessions=10)
    await host.handle(request("reset", session_ttl_s=0.05, task={"question": "q", "ground_truth": "1"}))
    assert host.expire_idle() == []
    time.sleep(0.1)
    assert [sid for sid, _ in host.expire_idle()] == ["s"] and not host.sessions
