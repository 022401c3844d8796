"""The trainer's drops over real Redis/Postgres, in process and without a model: groups it will never train on
(stale, filtered, missing a slot the controller announced out of attempts) are recorded in `train_samples` at
once, reported on `trainer.progress` and acknowledged, and the controller's count of consumed-without-a-step
groups (which widens its dispatch window), fed only by those reports, sees them."""

from __future__ import annotations

import asyncio
import time
import uuid

import pytest
from sqlalchemy import text

from services.controller import trainer_groups
from services.trainer.batch import GroupBuffer
from services.trainer.loop import RunState, Trainer
from services.trainer.settings import TrainerSettings
from shared.contracts.messages import (
    AcceptedResult,
    EpisodeResult,
    RunControl,
    TrainerProgress,
    TrajectoryRecord,
    decode,
    encode,
)
from shared.contracts.run_config import RunConfig
from shared.contracts.streams import ACCEPTED_RESULTS, GROUP_TRAIN, RUN_CONTROL, TRAINER_PROGRESS
from shared.platform import leases
from shared.platform.bus import connect
from shared.platform.db.session import make_engine
from shared.sdk.types import TerminationReason
from tests.support.procs import wait_until_async


@pytest.fixture
async def trainer(isolated_urls, tmp_path):
    redis_url, database_url = isolated_urls
    redis, engine = connect(redis_url), make_engine(database_url)
    await redis.delete(ACCEPTED_RESULTS, TRAINER_PROGRESS)
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


async def _accepted(trainer: Trainer, *results: EpisodeResult) -> None:
    """What the store publishes after accepting `results`."""
    for r in results:
        await trainer.redis.xadd(ACCEPTED_RESULTS, encode(AcceptedResult.stored(r)))


async def _final_failure(trainer: Trainer, run_id: str, task: str, sample: int, batch: int) -> None:
    """What the controller announces when a slot is out of attempts."""
    await trainer.redis.xadd(ACCEPTED_RESULTS, encode(AcceptedResult(
        run_id=run_id, task_id=task, sample_idx=sample, attempt=0, batch_idx=batch)))


async def _controller_count(trainer: Trainer, run_id: str, final_failed: list[tuple[str, int]]) -> int:
    """The controller's count of dropped groups after it applied every `trainer.progress` report so far."""
    reports = [decode(f, TrainerProgress) for _, f in await trainer.redis.xrange(TRAINER_PROGRESS)]
    trainer_groups.record_progress(trainer.db, reports)
    with trainer.db.connect() as c:
        return trainer_groups.dropped_groups(c, run_id, final_failed)


def _recorded(trainer: Trainer, run_id: str) -> dict[tuple[str, int], str]:
    with trainer.db.connect() as c:
        rows = c.execute(text("SELECT task_id, sample_idx, status FROM train_samples WHERE run_id = :r"),
                         {"r": run_id}).all()
    return {(r.task_id, r.sample_idx): r.status for r in rows}


async def _pending(trainer: Trainer) -> int:
    return (await trainer.redis.xpending(ACCEPTED_RESULTS, GROUP_TRAIN))["pending"]


async def test_dropped_groups_are_recorded_at_once_acknowledged_and_counted_by_the_controller(trainer):
    run = _add_run(trainer, version=1)
    r = run.run_id
    results = [
        _result(r, "flat", 0, 1.0, 1, 1), _result(r, "flat", 1, 1.0, 1, 1),  # no signal: filtered
        _result(r, "old", 0, 1.0, 0, 0), _result(r, "old", 1, 0.0, 0, 0),  # made by v0, trained at v1: stale
        _result(r, "good", 0, 1.0, 1, 1), _result(r, "good", 1, 0.0, 1, 1),  # trainable, waits for a 2nd group
        _result(r, "half", 0, 1.0, 1, 1),  # its slot 1 is out of attempts: can never complete
    ]
    await _accepted(trainer, *results)
    await trainer.route(await trainer.consumer.read())
    await trainer.maybe_step(run)  # no step (one trainable group of two), but the drops are recorded now
    assert _recorded(trainer, r) == {("flat", 0): "filtered", ("flat", 1): "filtered",
                                     ("old", 0): "stale", ("old", 1): "stale"}
    assert await _pending(trainer) == 3  # good's two and half's one are still held
    assert {k[0] for k in run.buffer.groups} == {"good", "half"}

    await trainer.drop_unfinishable(run)  # nothing failed yet: half keeps waiting
    assert await _pending(trainer) == 3
    await _final_failure(trainer, r, "half", 1, 1)
    await _final_failure(trainer, r, "ghost", 0, 1)  # a group none of whose samples arrived
    await trainer.route(await trainer.consumer.read())
    assert _recorded(trainer, r)[("half", 0)] == "incomplete"
    assert _recorded(trainer, r)[("half", 1)] == _recorded(trainer, r)[("ghost", 0)] == "abandoned"
    assert await _pending(trainer) == 2 and {k[0] for k in run.buffer.groups} == {"good"}
    assert run.dropped == {"filtered": 2, "stale": 2, "incomplete": 1}  # the next step's metrics

    # A crash between the record and the ack re-delivers a recorded entry: it is a duplicate, acknowledged.
    await _accepted(trainer, results[0])
    await trainer.route(await trainer.consumer.read())
    assert await _pending(trainer) == 2 and run.counts["duplicate"] == 1

    # A held result published again (the controller's replay after Redis lost its data): the newer entry is
    # held and the older acknowledged, so what stays pending is what survives in the stream.
    older = run.held[(r, "good", 0)].id
    await _accepted(trainer, results[4])
    await trainer.route(await trainer.consumer.read())
    assert run.held[(r, "good", 0)].id != older and await _pending(trainer) == 2

    # flat, old, half (once, though dropped and finally failed), ghost
    assert await _controller_count(trainer, r, [("half", 1), ("ghost", 1)]) == 4
    assert await _controller_count(trainer, r, []) == 3


async def test_a_run_opened_later_claims_the_entries_a_dead_trainer_left_pending(trainer, monkeypatch):
    """Entries another trainer read and never acknowledged (it died) are delivered to the trainer that opens
    their run, though it was already running; entries of a run another live trainer owns stay pending."""

    def lease(run_id: str, owner: str, ttl_s: float) -> None:
        with trainer.db.begin() as c:
            assert leases.acquire(c, leases.TRAINER, owner, [run_id], ttl_s) == {run_id}

    mine, theirs = _add_run(trainer, 0), _add_run(trainer, 0)
    trainer.runs.clear()  # in the database only: the serve loop opens them through its own path
    states = {mine.run_id: mine, theirs.run_id: theirs}
    monkeypatch.setattr(trainer, "_build_run", lambda row: states[row.id])  # no model: intake only
    monkeypatch.setattr(trainer.settings, "runs_poll_s", 0.1)
    for run in (mine, theirs):  # one sample of two: held, never a step
        await _accepted(trainer, _result(run.run_id, "a", 0, 1.0, 0, 0))
    await trainer.bus.ensure_group(ACCEPTED_RESULTS, GROUP_TRAIN)
    await trainer.redis.xreadgroup(GROUP_TRAIN, "dead-trainer", {ACCEPTED_RESULTS: ">"})  # read, never acked
    lease(mine.run_id, "dead-trainer", 3.0)  # it stopped renewing: expires in 3 s
    lease(theirs.run_id, "live-trainer", 600)

    async def owners() -> dict[str, int]:
        info = await trainer.redis.xpending(ACCEPTED_RESULTS, GROUP_TRAIN)
        return {c["name"].decode(): c["pending"] for c in info["consumers"]}

    stop = asyncio.Event()
    serving = asyncio.create_task(trainer.serve(stop))
    try:
        async def started() -> bool:  # its start-up claim took both entries, kept neither (both runs foreign)
            return await owners() == {"trainer-a": 2}
        await wait_until_async(started, 20, "the start-up claim")
        assert not trainer.runs and not mine.held

        async def taken_over() -> bool:  # once the dead trainer's lease expired
            return bool(mine.held)
        await wait_until_async(taken_over, 20, "the run's pending entry delivered to its new trainer")
        assert {k[1:] for k in mine.held} == {("a", 0)}
        assert theirs.run_id not in trainer.runs and not theirs.held
        assert (await trainer.redis.xpending(ACCEPTED_RESULTS, GROUP_TRAIN))["pending"] == 2  # nothing acked
    finally:
        stop.set()
        await serving


async def test_a_stop_on_run_control_lets_the_run_go_at_once(trainer, monkeypatch):
    """The API's stop reaches the trainer on `run.control`: it lets the run go and acknowledges what it held at
    once, though it reads the runs table only every 60 s here."""
    run = _add_run(trainer, 0)
    trainer.runs.clear()  # opened by the serve loop itself
    monkeypatch.setattr(trainer, "_build_run", lambda row: run)  # no model: intake only
    monkeypatch.setattr(trainer.settings, "runs_poll_s", 60.0)
    await _accepted(trainer, _result(run.run_id, "a", 0, 1.0, 0, 0))  # one sample of two: held, never a step
    stop = asyncio.Event()
    serving = asyncio.create_task(trainer.serve(stop))
    try:
        async def held() -> bool:
            return bool(run.held)
        await wait_until_async(held, 20, "the sample held")
        with trainer.db.begin() as c:  # what the API does: the status first, then the command
            c.execute(text("UPDATE runs SET status = 'stopping' WHERE id = :id"), {"id": run.run_id})
        await trainer.redis.xadd(RUN_CONTROL, encode(RunControl(run_id=run.run_id, action="stop",
                                                                sent_at=time.time())))

        async def let_go() -> bool:
            return run.run_id not in trainer.runs and await _pending(trainer) == 0
        await wait_until_async(let_go, 5.0, "the run let go and its sample acknowledged")
    finally:
        stop.set()
        await asyncio.wait_for(serving, 30)


async def test_a_stored_result_never_trained_on_drops_its_group_even_after_a_restart(trainer):
    """A completed result with nothing to train on (the prompt was too long, no token generated) is final: the
    controller does not retry it, so its group can never complete. It is recorded as excluded, its group's
    other samples (before or after it) are dropped as incomplete, and the controller counts the group."""
    run = _add_run(trainer, version=0)
    r = run.run_id
    empty = _result(r, "long", 1, 0.0, 0, 0).model_copy(update={
        "termination_reason": TerminationReason.PROMPT_TRUNCATION,
        "trajectories": [TrajectoryRecord(uid="x", reward=0.0, termination_reason="prompt_truncation")]})
    await _accepted(trainer, _result(r, "long", 0, 1.0, 0, 0), empty)
    await trainer.route(await trainer.consumer.read())
    assert _recorded(trainer, r) == {("long", 1): "excluded", ("long", 0): "incomplete"}
    assert not run.buffer.groups and await _pending(trainer) == 0  # all acknowledged
    assert run.dropped == {"incomplete": 1}

    # epoch 1 of the same task is another group: not affected.
    await _accepted(trainer, _result(r, "long", 2, 1.0, 0, 1))
    await trainer.route(await trainer.consumer.read())
    assert ("long", 2) not in _recorded(trainer, r)
    assert {k[0] for k in run.buffer.groups} == {"long"}

    # a restarted trainer knows the doomed groups from its own record: a late sample of one is dropped at once
    late = _result(r, "gone", 0, 1.0, 0, 0)
    with trainer.db.begin() as c:
        c.execute(text("INSERT INTO train_samples (run_id, task_id, sample_idx, attempt, status, version, batch_idx) "
                       "VALUES (:r, 'gone', 1, 0, 'excluded', 0, 0)"), {"r": r})
    from services.trainer import run_store as db
    run.unfinishable = db.unfinishable_groups(trainer.db, r)  # as _build_run loads it
    assert ("gone", 0) in run.unfinishable
    await _accepted(trainer, late)
    await trainer.route(await trainer.consumer.read())
    assert _recorded(trainer, r)[("gone", 0)] == "incomplete"
    assert await _controller_count(trainer, r, []) == 2  # long (epoch 0) and gone


async def test_a_context_exceeded_result_is_held_with_no_loss_and_counted(trainer):
    """Not a drop: a trajectory cut by the context window joins its group (its reward is the group's), with a zero
    loss mask per algorithm.mask_termination (by default), counted in the step's samples_masked_context_exceeded."""
    run = _add_run(trainer, version=0)
    cut = _result(run.run_id, "t", 0, 0.0, 0, 0)
    cut = cut.model_copy(update={"termination_reason": TerminationReason.CONTEXT_EXCEEDED, "trajectories": [
        cut.trajectories[0].model_copy(update={"termination_reason": TerminationReason.CONTEXT_EXCEEDED})]})
    await _accepted(trainer, cut, _result(run.run_id, "t", 1, 1.0, 0, 0))
    await trainer.route(await trainer.consumer.read())
    assert _recorded(trainer, run.run_id) == {}  # nothing excluded or dropped
    [group] = run.buffer.complete_groups()
    assert {i: s.loss_mask for (i, _), s in group.samples.items()} == {0: [0], 1: [1]}
    assert run.counts["masked_context_exceeded"] == 1 and run.counts["held"] == 2
