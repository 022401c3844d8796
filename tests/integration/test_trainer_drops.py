"""The trainer's drops over real Redis/Postgres, in process and without a model: groups it will never train on
(stale, filtered, missing a finally failed slot) are recorded in `train_samples` at once and acknowledged, and
the controller's count of consumed-without-a-step groups (which widens its dispatch window) sees them."""

from __future__ import annotations

import asyncio
import uuid

import pytest
from sqlalchemy import text

from services.controller import ledger
from services.trainer.batch import GroupBuffer
from services.trainer.config import TrainerSettings
from services.trainer.loop import RunState, Trainer
from shared.bus import connect
from shared.db.session import make_engine
from shared.messages import EpisodeResult, TrajectoryRecord, encode
from shared.run_config import RunConfig
from shared.streams import GROUP_TRAIN, TRAJECTORIES, trainer_lease_key
from shared.types import TerminationReason


@pytest.fixture
async def trainer(isolated_urls, tmp_path):
    redis_url, database_url = isolated_urls
    redis, engine = connect(redis_url), make_engine(database_url)
    await redis.delete(TRAJECTORIES)
    t = Trainer(TrainerSettings(redis_url=redis_url, database_url=database_url, state_dir=tmp_path), redis, engine,
                "trainer-a")
    await t.consumer.start()
    yield t
    t.torch_thread.shutdown()
    await redis.aclose()
    engine.dispose()


def _add_run(trainer: Trainer, version: int, **overrides) -> RunState:
    config = RunConfig(**({"name": "drops", "model": "m", "dataset": "d", "agent": {"name": "math"},
                           "env": {"name": "math"}, "samples_per_task": 2, "tasks_per_batch": 2,
                           "max_staleness": 0, "stale_policy": "drop", "max_attempts": 1,
                           "algorithm": {"dynamic_sampling": True}} | overrides))
    run_id = str(uuid.uuid4())
    with trainer.db.begin() as c:
        c.execute(text("INSERT INTO runs (id, name, kind, status, config, policy_version, summary) "
                       "VALUES (:id, 'drops', 'train', 'running', CAST(:cfg AS jsonb), :v, '{}')"),
                  {"id": run_id, "cfg": config.model_dump_json(), "v": version})
    run = RunState(run_id, config, version, None, None, None, GroupBuffer(2, need_greedy=False))
    trainer.runs[run_id] = run
    return run


def _result(run_id: str, task: str, sample: int, reward: float, version: int, batch: int) -> EpisodeResult:
    traj = TrajectoryRecord(uid=uuid.uuid4().hex, reward=reward, termination_reason="env_done", prompt_ids=[1, 2],
                            response_ids=[3], loss_mask=[1], logprobs=[-1.0], versions=[version])
    return EpisodeResult(run_id=run_id, task_id=task, sample_idx=sample, status="completed",
                         termination_reason="env_done", reward=reward, trajectories=[traj], batch_idx=batch)


def _final_failure(trainer: Trainer, run_id: str, task: str, sample: int, batch: int) -> None:
    """What the controller leaves when a slot is out of attempts: a failed ledger row and the run event."""
    with trainer.db.begin() as c:
        c.execute(text("INSERT INTO rollout_tasks (run_id, task_id, sample_idx, attempt, status, batch_idx, epoch, "
                       "greedy, dispatch_version) VALUES (:r, :t, :s, 0, 'failed', :b, 0, false, 0)"),
                  {"r": run_id, "t": task, "s": sample, "b": batch})
        ledger.add_event(c, run_id, "final_failure", f"{task}/{sample} is out of attempts (1)",
                         {"task_id": task, "sample_idx": sample, "attempt": 0})


def _recorded(trainer: Trainer, run_id: str) -> dict[tuple[str, int], str]:
    with trainer.db.connect() as c:
        rows = c.execute(text("SELECT task_id, sample_idx, status FROM train_samples WHERE run_id = :r"),
                         {"r": run_id}).all()
    return {(r.task_id, r.sample_idx): r.status for r in rows}


async def _pending(trainer: Trainer) -> int:
    return (await trainer.redis.xpending(TRAJECTORIES, GROUP_TRAIN))["pending"]


async def test_dropped_groups_are_recorded_at_once_acknowledged_and_counted_by_the_controller(trainer):
    run = _add_run(trainer, version=1)
    r = run.run_id
    results = [
        _result(r, "flat", 0, 1.0, 1, 1), _result(r, "flat", 1, 1.0, 1, 1),  # no signal: filtered
        _result(r, "old", 0, 1.0, 0, 0), _result(r, "old", 1, 0.0, 0, 0),  # made by v0, trained at v1: stale
        _result(r, "good", 0, 1.0, 1, 1), _result(r, "good", 1, 0.0, 1, 1),  # trainable, waits for a 2nd group
        _result(r, "half", 0, 1.0, 1, 1),  # its slot 1 is out of attempts: can never complete
    ]
    for msg in results:
        await trainer.redis.xadd(TRAJECTORIES, encode(msg))
    await trainer.route(await trainer.consumer.read())
    await trainer.maybe_step(run)  # no step (one trainable group of two), but the drops are recorded now
    assert _recorded(trainer, r) == {("flat", 0): "filtered", ("flat", 1): "filtered",
                                     ("old", 0): "stale", ("old", 1): "stale"}
    assert await _pending(trainer) == 3  # good's two and half's one are still held
    assert {k[0] for k in run.buffer.groups} == {"good", "half"}

    await trainer.drop_unfinishable(run, refresh=True)  # nothing failed yet: half keeps waiting
    assert await _pending(trainer) == 3
    _final_failure(trainer, r, "half", 1, 1)
    _final_failure(trainer, r, "ghost", 0, 1)  # a group none of whose samples arrived: only the controller knows
    await trainer.drop_unfinishable(run, refresh=True)
    assert _recorded(trainer, r)[("half", 0)] == "incomplete"
    assert await _pending(trainer) == 2 and {k[0] for k in run.buffer.groups} == {"good"}
    assert run.dropped == {"filtered": 2, "stale": 2, "incomplete": 1}  # the next step's metrics

    # A crash between the record and the ack re-delivers a recorded entry: it is a duplicate, acknowledged.
    await trainer.redis.xadd(TRAJECTORIES, encode(results[0]))
    await trainer.route(await trainer.consumer.read())
    assert await _pending(trainer) == 2 and run.counts["duplicate"] == 1

    with trainer.db.begin() as c:  # flat, old, half (once, though dropped and finally failed), ghost
        assert ledger.dropped_groups(c, r, 2, {("half", 1), ("ghost", 0)}) == 4
        assert ledger.dropped_groups(c, r, 2, set()) == 3


async def _wait(pred, what: str, timeout_s: float = 20.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not await pred():
        assert asyncio.get_running_loop().time() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.05)


async def test_a_run_opened_later_claims_the_entries_a_dead_trainer_left_pending(trainer, monkeypatch):
    """Entries another trainer read and never acknowledged (it died) are delivered to the trainer that opens
    their run, though it was already running; entries of a run another live trainer owns stay pending."""
    mine, theirs = _add_run(trainer, 0), _add_run(trainer, 0)
    trainer.runs.clear()  # in the database only: the serve loop opens them through its own path
    states = {mine.run_id: mine, theirs.run_id: theirs}
    monkeypatch.setattr(trainer, "_build_run", lambda row: states[row.id])  # no model: intake only
    monkeypatch.setattr(trainer.settings, "runs_poll_s", 0.1)
    for run in (mine, theirs):  # one sample of two: held, never a step
        await trainer.redis.xadd(TRAJECTORIES, encode(_result(run.run_id, "a", 0, 1.0, 0, 0)))
    await trainer.redis.xreadgroup(GROUP_TRAIN, "dead-trainer", {TRAJECTORIES: ">"})  # read, never acked
    await trainer.redis.set(trainer_lease_key(mine.run_id), "dead-trainer")  # until its lease expires
    await trainer.redis.set(trainer_lease_key(theirs.run_id), "live-trainer")

    async def owners() -> dict[str, int]:
        info = await trainer.redis.xpending(TRAJECTORIES, GROUP_TRAIN)
        return {c["name"].decode(): c["pending"] for c in info["consumers"]}

    stop = asyncio.Event()
    serving = asyncio.create_task(trainer.serve(stop))
    try:
        async def started() -> bool:  # its start-up claim took both entries, kept neither (both runs foreign)
            return await owners() == {"trainer-a": 2}
        await _wait(started, "the start-up claim")
        assert not trainer.runs and not mine.held

        await trainer.redis.delete(trainer_lease_key(mine.run_id))  # the dead trainer's lease expired

        async def taken_over() -> bool:
            return bool(mine.held)
        await _wait(taken_over, "the run's pending entry delivered to its new trainer")
        assert {k[1:] for k in mine.held} == {("a", 0)}
        assert theirs.run_id not in trainer.runs and not theirs.held
        assert (await trainer.redis.xpending(TRAJECTORIES, GROUP_TRAIN))["pending"] == 2  # nothing acked
    finally:
        stop.set()
        await serving


async def test_a_stored_result_never_trained_on_drops_its_group_even_after_a_restart(trainer):
    """A completed result with nothing to train on (the prompt was too long, no token generated) is final: the
    controller does not retry it, so its group can never complete. It is recorded as excluded, its group's
    other samples (before or after it) are dropped as incomplete, and the controller counts the group."""
    run = _add_run(trainer, version=0)
    r = run.run_id
    empty = _result(r, "long", 1, 0.0, 0, 0).model_copy(update={
        "termination_reason": TerminationReason.PROMPT_TRUNCATION,
        "trajectories": [TrajectoryRecord(uid="x", reward=0.0, termination_reason="prompt_truncation")]})
    failed = _result(r, "retry", 0, 0.0, 0, 0).model_copy(update={"status": "failed", "trajectories": []})
    for msg in (_result(r, "long", 0, 1.0, 0, 0), empty, failed):
        await trainer.redis.xadd(TRAJECTORIES, encode(msg))
    await trainer.route(await trainer.consumer.read())
    assert _recorded(trainer, r) == {("long", 1): "excluded", ("long", 0): "incomplete"}
    assert not run.buffer.groups and await _pending(trainer) == 0  # all acknowledged
    assert run.dropped == {"incomplete": 1}

    # epoch 1 of the same task is another group: not affected. A failed attempt is retried by the controller,
    # so it is not recorded (its retry must not be a duplicate).
    await trainer.redis.xadd(TRAJECTORIES, encode(_result(r, "long", 2, 1.0, 0, 1)))
    await trainer.route(await trainer.consumer.read())
    assert ("long", 2) not in _recorded(trainer, r) and ("retry", 0) not in _recorded(trainer, r)
    assert {k[0] for k in run.buffer.groups} == {"long"}

    # a restarted trainer knows the excluded groups from the database: a late sample of one is dropped at once
    late = _result(r, "gone", 0, 1.0, 0, 0)
    with trainer.db.begin() as c:
        c.execute(text("INSERT INTO rollout_tasks (run_id, task_id, sample_idx, attempt, status, batch_idx, epoch, "
                       "greedy, dispatch_version) VALUES (:r, 'gone', 1, 0, 'completed', 0, 0, false, 0)"), {"r": r})
        c.execute(text("INSERT INTO train_samples (run_id, task_id, sample_idx, attempt, status, version) "
                       "VALUES (:r, 'gone', 1, 0, 'excluded', 0)"), {"r": r})
    from services.trainer import runs as db
    run.unfinishable = db.unfinishable_groups(trainer.db, r)  # as _build_run loads it
    assert ("gone", 0) in run.unfinishable
    await trainer.redis.xadd(TRAJECTORIES, encode(late))
    await trainer.route(await trainer.consumer.read())
    assert _recorded(trainer, r)[("gone", 0)] == "incomplete"
    with trainer.db.begin() as c:  # long (epoch 0) and gone
        assert ledger.dropped_groups(c, r, 2, set()) == 2
