"""Run control as commands (shared/contracts/messages/control.py): the controller is the one writer of `runs` and
`run_events`; the API and eval jobs send `RunCommand`s on `run.commands` and wait for its reply
(shared/clients/run_commands.py). A real controller process on the real Postgres and Redis:

- a command is applied once, however often it is delivered, and answered the same way each time;
- a pause, resume or stop applied is announced on `run.control`; a refused one is not;
- a command read after it expired is not applied, so a sender that gave up ("nothing changed") told the truth;
- a tinker run ends as its client says (complete, fail with the reason as its error, stop), with nothing on
  `run.control`; other runs refuse complete and fail;
- with no controller, the API answers 503 and no run appears, even once a controller starts later.
"""

from __future__ import annotations

import time
import uuid

import pytest
import redis
from api_testlib import running_api
from sqlalchemy import insert, select, update
from sqlalchemy.orm import Session

from shared.clients.run_commands import ControllerUnavailable, create_run, run_command
from shared.contracts.db.models import Dataset, DatasetRow, Run, RunEvent
from shared.contracts.messages import RunCommand, RunCommandReply, RunControl, decode
from shared.contracts.run_config import RunConfig
from shared.contracts.streams import RUN_COMMANDS, RUN_CONTROL, command_reply
from shared.contracts.tinker_run import TinkerRunConfig
from shared.platform.bus import announce, await_answer
from shared.platform.db.session import make_engine
from tests.support.procs import ServiceGroup, wait_heartbeat, wait_until


@pytest.fixture(scope="module")
def urls(isolated_urls):
    return isolated_urls


@pytest.fixture(scope="module")
def engine(urls):
    eng = make_engine(urls[1])
    with eng.begin() as c:
        ds = uuid.uuid4()
        c.execute(insert(Dataset).values(id=ds, name="cmds", split="train", source="test", num_rows=3, info={}))
        c.execute(insert(DatasetRow), [dict(dataset_id=ds, idx=i, task_id=f"t{i}",
                                            data={"question": f"{i}+{i}?", "answer": str(2 * i)}) for i in range(3)])
    yield eng
    eng.dispose()


@pytest.fixture(scope="module")
def sync_redis(urls):
    client = redis.Redis.from_url(urls[0])
    yield client
    client.close()


@pytest.fixture
def controller(urls, tmp_path):
    with ServiceGroup(tmp_path, redis_url=urls[0], database_url=urls[1], max_runs="0") as group:
        proc = group.start("controller", "services.controller.main", worker_id="ctl-cmds")
        wait_heartbeat(urls[0], "controller", "ctl-cmds", proc)
        yield proc


def config(name: str) -> RunConfig:
    return RunConfig(name=name, model="m", dataset="cmds", agent={"name": "math"}, env={"name": "math"},
                     samples_per_task=2)


def send(sync_redis, cmd: RunCommand, wait_s: float = 10.0) -> RunCommandReply:
    announce(sync_redis, RUN_COMMANDS, cmd)
    reply = await_answer(sync_redis, command_reply(cmd.command_id), RunCommandReply, time.monotonic() + wait_s)
    assert reply is not None, f"no reply to {cmd.action} within {wait_s} s"
    return reply


def command(run_id: str, action: str, **over) -> RunCommand:
    now = time.time()
    return RunCommand(**{"command_id": uuid.uuid4().hex, "run_id": run_id, "action": action, "sent_at": now,
                         "expires_at": now + 10, **over})


def events(engine, run_id: str) -> list[RunEvent]:
    with Session(engine) as s:
        return list(s.execute(select(RunEvent).where(RunEvent.run_id == uuid.UUID(run_id))
                              .order_by(RunEvent.id)).scalars())


def status(engine, run_id: str) -> str | None:
    with Session(engine) as s:
        return s.execute(select(Run.status).where(Run.id == uuid.UUID(run_id))).scalar()


def control_actions(sync_redis, run_id: str) -> list[str]:
    return [c.action for c in (decode(f, RunControl) for _, f in sync_redis.xrange(RUN_CONTROL)) if c.run_id == run_id]


def test_each_command_is_applied_once_however_often_it_is_delivered(controller, engine, sync_redis):
    with Session(engine) as s:
        run_id, rows = create_run(s, sync_redis, config("once"), check_paths=False, created_by="test")
    run_id = str(run_id)
    assert rows == 3 and status(engine, run_id) == "pending"
    [created] = events(engine, run_id)
    assert created.kind == "created" and created.data["rows"] == 3 and "by test" in created.message

    # the same create delivered again (its controller died before the ack): answered, not applied twice
    again = command(run_id, "create", command_id=created.data["command"], config=config("once").model_dump(mode="json"))
    assert send(sync_redis, again).outcome == "applied"
    assert [e.kind for e in events(engine, run_id)] == ["created"]

    refused = send(sync_redis, command(run_id, "pause"))
    assert (refused.outcome, refused.status) == ("refused", "pending") and "pause needs status running" in refused.message
    stop = command(run_id, "stop")
    assert (send(sync_redis, stop).outcome, status(engine, run_id)) == ("applied", "stopping")
    assert send(sync_redis, stop).outcome == "applied"  # redelivered after it was applied
    changes = [e for e in events(engine, run_id) if e.kind == "status_changed"]
    assert [(e.data["from"], e.data["to"], e.data["command"]) for e in changes] == [
        ("pending", "stopping", stop.command_id)]
    assert control_actions(sync_redis, run_id) in (["stop"], ["stop", "stop"])  # a redelivery may announce again
    assert send(sync_redis, command(str(uuid.uuid4()), "resume")).outcome == "not_found"


def test_a_command_read_after_it_expired_changes_nothing(controller, engine, sync_redis):
    with Session(engine) as s:
        run_id, _ = create_run(s, sync_redis, config("late"), check_paths=False)
    run_id = str(run_id)
    with engine.begin() as c:
        c.execute(update(Run).where(Run.id == uuid.UUID(run_id)).values(status="running"))
    late = send(sync_redis, command(run_id, "pause", expires_at=time.time() - 1))
    assert (late.outcome, late.status, status(engine, run_id)) == ("expired", "running", "running")
    assert control_actions(sync_redis, run_id) == []
    stale_create = command(str(uuid.uuid4()), "create", config=config("late").model_dump(mode="json"),
                           expires_at=time.time() - 1)
    assert send(sync_redis, stale_create).outcome == "expired" and status(engine, stale_create.run_id) is None
    bad = send(sync_redis, command(str(uuid.uuid4()), "create", config={"name": "no model"}))
    assert bad.outcome == "refused" and "not a valid run config" in bad.message


def test_a_tinker_run_ends_as_its_client_says_and_other_runs_refuse_complete_and_fail(controller, engine,
                                                                                         sync_redis):
    def tinker_run() -> str:
        run_id = str(uuid.uuid4())
        cfg = TinkerRunConfig(name="t", model_id="s:train:0", session_id="s", owner="o", owner_name="k",
                              base_model="tiny", model="m", lora={"rank": 2})
        assert send(sync_redis, command(run_id, "create", config=cfg.model_dump(mode="json"))).status == "running"
        return run_id

    failed, completed, stopped = tinker_run(), tinker_run(), tinker_run()
    why = "its Tinker client ended session s as errored: loss was nan"
    reply = send(sync_redis, command(failed, "fail", reason=why))
    assert (reply.outcome, reply.status, status(engine, failed)) == ("applied", "failed", "failed")
    with Session(engine) as s:
        run = s.get(Run, uuid.UUID(failed))
        assert run.error == why and run.finished_at is not None
    assert [e.message for e in events(engine, failed) if e.kind == "status_changed"] == [f"running -> failed: {why}"]
    again = send(sync_redis, command(failed, "complete"))  # it ended as it ended
    assert (again.outcome, again.status) == ("refused", "failed") and "needs status" in again.message
    assert send(sync_redis, command(completed, "complete")).status == "completed"
    assert send(sync_redis, command(stopped, "stop")).status == "stopped"
    with Session(engine) as s:
        assert s.get(Run, uuid.UUID(completed)).error is None
    assert control_actions(sync_redis, failed) == control_actions(sync_redis, completed) == []
    assert control_actions(sync_redis, stopped) == ["stop"]

    with Session(engine) as s:
        train_run, _ = create_run(s, sync_redis, config("driven"), check_paths=False)
    for action in ("complete", "fail"):
        refused = send(sync_redis, command(str(train_run), action, reason="no"))
        assert (refused.outcome, refused.status) == ("refused", "pending")
        assert "completes or fails by itself" in refused.message
    assert status(engine, str(train_run)) == "pending"


def test_without_a_controller_the_api_answers_503_and_no_run_appears_later(urls, engine, sync_redis, tmp_path):
    before = run_ids(engine)
    with running_api(urls[1], urls[0], tmp_path / "api", controller=False, RUN_COMMAND_WAIT_S="0.5",
                     CHECK_MODEL_PATHS="false") as api, \
            api.client() as client:
        r = client.post("/v1/runs", json=config("nobody").model_dump(mode="json"))
        assert r.status_code == 503, r.text
        assert "no controller applied the create" in r.json()["message"] and "nothing was changed" in r.json()["message"]
        with Session(engine) as s:
            with pytest.raises(ControllerUnavailable):
                run_command(s, sync_redis, uuid.uuid4(), "stop", wait_s=0.2)
        # a controller that starts now reads both commands, finds them expired and answers so
        with ServiceGroup(tmp_path, redis_url=urls[0], database_url=urls[1], max_runs="0") as group:
            proc = group.start("controller", "services.controller.main", worker_id="ctl-late")
            wait_heartbeat(urls[0], "controller", "ctl-late", proc)
            wait_until(lambda: not redis_pending(sync_redis), 30, "the controller to answer the commands it found")
        assert run_ids(engine) == before


def run_ids(engine) -> set[uuid.UUID]:
    with engine.connect() as c:
        return set(c.execute(select(Run.id)).scalars())


def redis_pending(sync_redis) -> int:
    groups = {g["name"]: g for g in sync_redis.xinfo_groups(RUN_COMMANDS)}
    g = groups.get(b"controller")
    return 1 if g is None else g["pending"] + (g.get("lag") or 0)
