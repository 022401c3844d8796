"""The controller as a real process over real Redis/Postgres. The test plays the rollout worker over the
wire: it consumes `rollout.tasks` in group "rollout" and answers with EpisodeResults on `trajectories`."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import time
import uuid
from collections.abc import Callable

import pytest
from api_testlib import running_api
from fixtures.aio import cancel_and_wait
from sqlalchemy import insert, select, text, update
from sqlalchemy.orm import Session

from services.controller.run_summary import ledger_summary
from shared.contracts.db.models import Dataset, DatasetRow, Run, RunEvent
from shared.contracts.messages import (
    AcceptedResult,
    ConsumedGroup,
    EpisodeResult,
    RolloutTask,
    TrainerProgress,
    TrajectoryRecord,
    decode,
    encode,
)
from shared.contracts.passk import pass_at_k_table
from shared.contracts.streams import (
    ACCEPTED_RESULTS,
    GROUP_ROLLOUT,
    ROLLOUT_TASKS,
    TRAINER_PROGRESS,
    TRAJECTORIES,
    dead_letter,
    heartbeat_key,
)
from shared.platform.bus import StreamBus
from shared.platform.db.session import make_engine
from tests.support.procs import REPO, ServiceGroup, stop, wait_until_async

pytestmark = pytest.mark.slow  # minutes of processes


@pytest.fixture(scope="module")
def engine(database_url):
    eng = make_engine(database_url)
    yield eng
    eng.dispose()


class Controllers:
    """The module's controller processes. `start()` with the module's settings hands out one controller shared by
    the module's tests (started on first use, and again after a test killed it): starting one per test cost
    more than most tests take. A test that sets other settings gets a controller of its own, the shared one
    stopped meanwhile so that no run of the test is taken by a controller with settings it did not ask for."""

    def __init__(self, group: ServiceGroup):
        self.group, self.shared, self.own = group, None, []

    def _start(self, **env) -> subprocess.Popen:
        n = len(self.group.procs)
        return self.group.start(f"controller-{n}", "services.controller.main", **{"worker_id": f"ctl-{n}", **env})

    def start(self, **env) -> subprocess.Popen:
        if not env:
            if self.shared is None or self.shared.poll() is not None:
                self.shared = self._start()
            return self.shared
        if self.shared is not None:
            stop(self.shared, 10)
            self.shared = None
        self.own.append(self._start(**env))
        return self.own[-1]

    def stop_own(self) -> None:
        for proc in self.own:
            stop(proc, 10)
        self.own.clear()


@pytest.fixture(scope="module")
def controllers(redis_url, database_url, tmp_path_factory):
    group = ServiceGroup(tmp_path_factory.mktemp("controllers"), redis_url=redis_url, database_url=database_url,
                         poll_interval_s="0.2", run_lease_s="2", reconcile_interval_s="0.3",
                         ledger_lease_margin_s="0", store_claim_idle_ms="1000", stop_timeout_s="5")
    yield Controllers(group)
    group.stop(10)


@pytest.fixture
def start_controller(controllers):
    yield controllers.start
    controllers.stop_own()


def add_dataset(engine, n: int, sources=("a", "b")) -> str:
    name, ds = f"ds-{uuid.uuid4().hex[:8]}", uuid.uuid4()
    with engine.begin() as c:
        c.execute(insert(Dataset).values(id=ds, name=name, split="train", source="test", num_rows=n, info={}))
        c.execute(insert(DatasetRow), [dict(dataset_id=ds, idx=i, task_id=f"t{i}", data={"i": i},
                                            data_source=sources[i % len(sources)]) for i in range(n)])
    return name


def add_run(engine, dataset: str, **cfg) -> str:
    config = dict(name="r", model="m", dataset=dataset, agent={"name": "math"}, env={"name": "math"}, **cfg)
    run_id = uuid.uuid4()
    with engine.begin() as c:
        c.execute(insert(Run).values(id=run_id, name="r", kind=config.get("kind", "train"), status="pending",
                                     config=config))
    return str(run_id)


def run_row(engine, run_id: str) -> Run:
    with Session(engine) as s:
        return s.get(Run, uuid.UUID(run_id))


def set_run(engine, run_id: str, **values) -> None:
    with engine.begin() as c:
        c.execute(update(Run).where(Run.id == uuid.UUID(run_id)).values(**values))


def events(engine, run_id: str, kind: str) -> list[dict]:
    with engine.connect() as c:
        return list(c.execute(select(RunEvent.data).where(RunEvent.run_id == uuid.UUID(run_id),
                                                          RunEvent.kind == kind).order_by(RunEvent.id)).scalars())


class FakeRolloutWorker:
    """Consumes rollout.tasks over the wire and answers with EpisodeResults. `answer(task)` returns
    "correct", "wrong", "failed" or None (never answer: the task is lost). Tracks tasks outstanding."""

    def __init__(self, redis, run_id: str, answer: Callable[[RolloutTask], str | None], hold_s: float = 0.0):
        self.redis, self.bus, self.run_id = redis, StreamBus(redis), run_id
        self.answer, self.hold_s = answer, hold_s
        self.received: list[RolloutTask] = []
        self.outstanding = 0
        self.max_outstanding = 0
        self.paused = False
        self.task: asyncio.Task | None = None

    async def __aenter__(self):
        await self.bus.ensure_group(ROLLOUT_TASKS, GROUP_ROLLOUT)
        self.task = asyncio.create_task(self._loop())
        return self

    async def __aexit__(self, *exc):
        await cancel_and_wait(self.task)

    async def _loop(self) -> None:
        while True:
            resp = await self.redis.xreadgroup(GROUP_ROLLOUT, "fake", {ROLLOUT_TASKS: ">"}, count=1000, block=100)
            entries = [(eid, decode(f)) for _, es in resp for eid, f in es]
            mine = [(eid, t) for eid, t in entries if t.run_id == self.run_id]
            self.received += [t for _, t in mine]
            self.outstanding += len(mine)
            self.max_outstanding = max(self.max_outstanding, self.outstanding)
            if self.hold_s and mine:  # give the controller a chance to over-dispatch, if it would
                await asyncio.sleep(self.hold_s)
            while self.paused:
                await asyncio.sleep(0.05)
            results = [r for _, t in mine if (r := self.result(t)) is not None]
            if results:
                await self.bus.publish_many(TRAJECTORIES, results)
            self.outstanding -= len(mine)
            if entries:
                await self.redis.xack(ROLLOUT_TASKS, GROUP_ROLLOUT, *[eid for eid, _ in entries])

    def result(self, t: RolloutTask) -> EpisodeResult | None:
        verdict = self.answer(t)
        if verdict is None:
            return None
        if verdict.startswith("error:"):  # the user's code failed, as the rollout worker reports it
            return user_error_result(t, verdict.removeprefix("error:"))
        ok = verdict == "correct"
        return episode_result(t, status="failed" if verdict == "failed" else "completed", correct=ok)

    def keys(self) -> list[tuple[str, int, int]]:
        return [(t.task_id, t.sample_idx, t.attempt) for t in self.received]


def episode_result(t: RolloutTask, status: str = "completed", correct: bool = True) -> EpisodeResult:
    traj = TrajectoryRecord(uid=uuid.uuid4().hex, reward=float(correct), termination_reason="env_done",
                            prompt_ids=[1, 2], response_ids=[3, 4], loss_mask=[1, 1], logprobs=[-0.1, -0.2])
    return EpisodeResult(
        run_id=t.run_id, task_id=t.task_id, sample_idx=t.sample_idx, attempt=t.attempt, status=status,
        termination_reason="env_done" if status == "completed" else "infra_error", is_correct=correct,
        reward=float(correct), task=t.task, trajectories=[traj] if status == "completed" else [],
        error=None if status == "completed" else "env session lost", worker_id="fake", batch_idx=t.batch_idx,
        greedy=t.greedy, started_at=time.time(), finished_at=time.time())


def user_error_result(t: RolloutTask, reason: str) -> EpisodeResult:
    return EpisodeResult(
        run_id=t.run_id, task_id=t.task_id, sample_idx=t.sample_idx, attempt=t.attempt, status="error",
        termination_reason="error", task=t.task, error=f"{reason}\nTraceback (most recent call last): ...",
        worker_id="fake", batch_idx=t.batch_idx, greedy=t.greedy, started_at=time.time(), finished_at=time.time())


def stored_keys(engine, run_id: str) -> list[tuple[str, int]]:
    with engine.connect() as c:
        return [tuple(r) for r in c.execute(text(
            "SELECT task_id, sample_idx FROM episodes WHERE run_id = :r AND status = 'completed'"), {"r": run_id})]


# -- eval: backpressure, completion, pass@k ----------------------------------------------------------------------
async def test_eval_run_backpressure_completion_and_passk(engine, redis_client, start_controller):
    run = add_run(engine, add_dataset(engine, 12), kind="eval", samples_per_task=3, max_in_flight=5)

    def answer(t: RolloutTask) -> str:
        i = int(t.task_id[1:])
        return "correct" if (i % 3 == 0 or (i % 3 == 1 and t.sample_idx == 0)) else "wrong"

    start_controller()
    async with FakeRolloutWorker(redis_client, run, answer, hold_s=0.15) as worker:
        await wait_until_async(lambda: run_row(engine, run).status == "completed", 30, "eval run completed")
    assert 0 < worker.max_outstanding <= 5
    assert sorted(worker.keys()) == sorted((f"t{i}", s, 0) for i in range(12) for s in range(3))
    row = run_row(engine, run)
    samples = [(t.task_id, "ab"[int(t.task_id[1:]) % 2], answer(t) == "correct") for t in worker.received]
    expected = pass_at_k_table(samples)
    assert row.summary["n"] == 3 and row.summary["num_tasks"] == 12
    for k in ("1", "2", "3"):
        assert row.summary["pass@k"][k] == pytest.approx(expected["pass@k"][k])
        for src in ("a", "b"):
            assert row.summary["by_source"][src]["pass@k"][k] == pytest.approx(expected["by_source"][src]["pass@k"][k])
    assert row.started_at is not None and row.finished_at is not None
    with engine.connect() as c:
        assert ledger_summary(c, run)["completed"] == 36
        metric = c.execute(text("SELECT (summary->'pass@k'->>'1')::float FROM runs WHERE id = :r"),
                           {"r": run}).scalar_one()  # pass@k in SQL: the run's summary (metrics are the trainer's)
        assert not c.execute(text("SELECT count(*) FROM metrics WHERE run_id = :r"), {"r": run}).scalar_one()
    assert metric == pytest.approx(expected["pass@k"]["1"])


# -- lost and failed attempts -------------------------------------------------------------------------------------
async def test_lost_task_is_redispatched_and_its_late_result_not_stored(engine, redis_client, start_controller):
    run = add_run(engine, add_dataset(engine, 3), kind="eval", samples_per_task=1, trajectory_timeout_s=1.0)
    held: list[RolloutTask] = []

    def answer(t: RolloutTask) -> str | None:
        if (t.task_id, t.attempt) == ("t0", 0):
            held.append(t)
            return None  # never answered: its lease expires
        return "correct"

    start_controller()
    async with FakeRolloutWorker(redis_client, run, answer) as worker:
        await wait_until_async(lambda: run_row(engine, run).status == "completed", 30,
                               "run completed after a loss")
        assert ("t0", 0, 1) in worker.keys()
        await StreamBus(redis_client).publish(TRAJECTORIES, episode_result(held[0]))  # the straggler arrives
        await wait_until_async(lambda: events(engine, run, "late_result"), 30, "late_result event")
    assert sorted(stored_keys(engine, run)) == [("t0", 0), ("t1", 0), ("t2", 0)]
    with engine.connect() as c:
        attempts = c.execute(text("SELECT attempt FROM episodes WHERE run_id = :r AND task_id = 't0'"),
                             {"r": run}).scalars().all()
        assert attempts == [1] and ledger_summary(c, run)["lost"] == 1
        ledger_lease = c.execute(text("SELECT lease_expires_at FROM rollout_tasks WHERE run_id = :r AND task_id = 't0' "
                                      "AND attempt = 0"), {"r": run}).scalar_one()
    assert events(engine, run, "lost")
    assert run_row(engine, run).summary["requeued"] == 1  # re-run, then scored: requeued, not a reason it ended unscored
    assert run_row(engine, run).summary["top_reasons"] == []
    with engine.connect() as c:
        assert c.execute(text("SELECT units_requeued FROM run_ledger WHERE run_id = :r"), {"r": run}).scalar_one() == 1
        assert not c.execute(text("SELECT * FROM run_error_reasons WHERE run_id = :r"), {"r": run}).all()
    # the task carries its lease (trajectory_timeout_s + a margin of 0), never earlier than the ledger's
    assert held[0].lease_expires_at == pytest.approx(held[0].dispatched_at + 1.0)
    assert ledger_lease.timestamp() <= held[0].lease_expires_at


async def test_tasks_a_live_worker_holds_past_their_lease_are_renewed_not_lost(engine, redis_client, start_controller):
    """A loaded machine makes trajectories slow: a live rollout worker that lists its tasks in its heartbeat keeps
    them past their 1 s lease (renewed), so nothing is lost or run twice."""
    run = add_run(engine, add_dataset(engine, 3), kind="eval", samples_per_task=1, trajectory_timeout_s=1.0)
    start_controller()
    async with FakeRolloutWorker(redis_client, run, lambda t: "correct", hold_s=4.0) as worker:
        async def heartbeat():
            while True:
                holds = [[t.run_id, t.task_id, t.sample_idx, t.attempt] for t in worker.received]
                await redis_client.set(heartbeat_key("rollout-worker", "fake"), json.dumps(
                    {"service": "rollout-worker", "worker_id": "fake", "holds": holds}), px=2000)
                await asyncio.sleep(0.2)

        beating = asyncio.create_task(heartbeat())
        try:
            await wait_until_async(lambda: run_row(engine, run).status == "completed", 30, "run completed")
        finally:
            await cancel_and_wait(beating)
    assert sorted(worker.keys()) == [("t0", 0, 0), ("t1", 0, 0), ("t2", 0, 0)]  # each run once
    assert run_row(engine, run).summary["ledger"]["lost"] == 0 and not events(engine, run, "lost")


async def test_tasks_waiting_unread_past_their_lease_are_restamped_not_lost(engine, redis_client, start_controller):
    """Every worker busy elsewhere: the run's tasks wait in rollout.tasks longer than their 1 s lease. The
    controller puts them back with a fresh lease (same attempt) instead of losing and re-running them."""
    run = add_run(engine, add_dataset(engine, 3), kind="eval", samples_per_task=1, trajectory_timeout_s=1.0)
    await StreamBus(redis_client).ensure_group(ROLLOUT_TASKS, GROUP_ROLLOUT)
    start_controller()
    await wait_until_async(lambda: ledger_of(engine, run)["in_flight"] == 3, 30, "3 tasks dispatched")
    await asyncio.sleep(4)  # four leases long, nobody reading
    assert ledger_of(engine, run)["lost"] == 0
    async with FakeRolloutWorker(redis_client, run, lambda t: "correct") as worker:
        await wait_until_async(lambda: run_row(engine, run).status == "completed", 30, "run completed")
    assert sorted(worker.keys()) == [("t0", 0, 0), ("t1", 0, 0), ("t2", 0, 0)]  # attempt 0 each, run once
    assert all(t.lease_expires_at > t.dispatched_at + 2 for t in worker.received)  # re-stamped while waiting
    assert run_row(engine, run).summary["ledger"]["lost"] == 0


def ledger_of(engine, run_id: str) -> dict:
    with engine.connect() as c:
        return ledger_summary(c, run_id)


async def test_dead_lettered_task_is_a_failed_attempt_and_retried(engine, redis_client, start_controller):
    """A rollout worker dead-lettered an attempt (`rollout.tasks.dlq`): the controller records it failed with the
    reason and dispatches the next attempt; an undecodable entry there holds nothing up."""
    run = add_run(engine, add_dataset(engine, 2), kind="eval", samples_per_task=1, max_attempts=3)
    doomed: list[RolloutTask] = []

    def answer(t: RolloutTask) -> str | None:
        if (t.task_id, t.attempt) == ("t1", 0):
            doomed.append(t)
            return None  # dead-lettered below instead of answered
        return "correct"

    start_controller()  # the task lease (trajectory_timeout_s, 10 min) outlives the test: only the dead letter ends it
    async with FakeRolloutWorker(redis_client, run, answer) as worker:
        await wait_until_async(lambda: doomed, 30, "t1 dispatched")
        dlq = dead_letter(ROLLOUT_TASKS)
        await redis_client.xadd(dlq, {b"junk": b"1"})
        await redis_client.xadd(dlq, {**encode(doomed[0]), b"dlq_reason": b"handler failed 5 times: boom"})
        await wait_until_async(lambda: run_row(engine, run).status == "completed", 30, "run completed")
    assert ("t1", 0, 1) in worker.keys()
    [event] = events(engine, run, "dead_lettered")
    assert event == {"stream": ROLLOUT_TASKS, "task_id": "t1", "sample_idx": 0, "attempt": 0}
    assert run_row(engine, run).summary["ledger"]["failed"] == 1
    assert await redis_client.xlen(dead_letter(dlq)) == 1  # the junk, moved on with its reason


async def test_failed_attempt_retried_until_final_failure(engine, redis_client, start_controller):
    run = add_run(engine, add_dataset(engine, 3), kind="eval", samples_per_task=1, max_attempts=3)
    start_controller()
    async with FakeRolloutWorker(redis_client, run, lambda t: "failed" if t.task_id == "t1" else "correct") as w:
        await wait_until_async(lambda: run_row(engine, run).status == "completed", 30, "run completed")
    assert sorted(k for k in w.keys() if k[0] == "t1") == [("t1", 0, 0), ("t1", 0, 1), ("t1", 0, 2)]
    assert events(engine, run, "final_failure") == [{"task_id": "t1", "sample_idx": 0, "attempt": 2}]
    summary = run_row(engine, run).summary
    assert summary["final_failures"] == 1 and summary["ledger"]["failed"] == 3
    assert sorted(stored_keys(engine, run)) == [("t0", 0), ("t2", 0)]


async def test_attempts_failing_for_one_reason_fail_the_run_fast_with_that_reason(engine, redis_client,
                                                                                 start_controller):
    """Every attempt fails the same way (as with a model path that does not exist): the run ends `failed` with
    the reason in runs.error after its first 12 attempts (one per unit: fail fast scales with a small run; a
    large one waits max(20, 2 * max_in_flight)), not `completed` after all 36, and nothing more is dispatched."""
    run = add_run(engine, add_dataset(engine, 12), kind="eval", samples_per_task=1, max_attempts=3, max_in_flight=4)
    start_controller()
    async with FakeRolloutWorker(redis_client, run, lambda t: "failed") as worker:
        await wait_until_async(lambda: run_row(engine, run).status == "failed", 30, "run failed")
        dispatched = len(worker.received)
        await asyncio.sleep(0.8)
        assert len(worker.received) == dispatched < 36
    row = run_row(engine, run)
    assert row.error == "12 attempts in a row failed: env session lost"
    with engine.connect() as c:
        assert ledger_summary(c, run)["in_flight"] == 0  # cancelled: the run holds nothing any more


class SlotWorker:
    """A rollout worker with `slots` tasks at once that reads the shared FIFO stream only while a slot is free
    (as the real one does); a task of run r takes `latency[r]` seconds."""

    def __init__(self, redis, slots: int, latency: dict[str, float]):
        self.redis, self.bus, self.slots, self.latency = redis, StreamBus(redis), slots, latency
        self.running: set[asyncio.Task] = set()
        self.done = {r: 0 for r in latency}
        self.timeline: list[tuple[str, int]] = []  # (run id, +1 at a task's start, -1 when its work is done)
        self.task: asyncio.Task | None = None

    async def __aenter__(self):
        await self.bus.ensure_group(ROLLOUT_TASKS, GROUP_ROLLOUT)
        self.task = asyncio.create_task(self._loop())
        return self

    async def __aexit__(self, *exc):
        await cancel_and_wait(self.task, *self.running)

    async def _loop(self) -> None:
        while True:
            free = self.slots - len(self.running)
            if not free:
                await asyncio.sleep(0.01)
                continue
            resp = await self.redis.xreadgroup(GROUP_ROLLOUT, "slots", {ROLLOUT_TASKS: ">"}, count=free, block=100)
            for _, entries in resp:
                for eid, fields in entries:
                    job = asyncio.create_task(self._run(eid, decode(fields)))
                    self.running.add(job)
                    job.add_done_callback(self.running.discard)

    async def _run(self, eid: bytes, t: RolloutTask) -> None:
        self.timeline.append((t.run_id, 1))
        await asyncio.sleep(self.latency[t.run_id])
        self.timeline.append((t.run_id, -1))  # before publishing: the controller cannot react to it earlier
        await self.bus.publish(TRAJECTORIES, episode_result(t))
        await self.redis.xack(ROLLOUT_TASKS, GROUP_ROLLOUT, eid)
        self.done[t.run_id] += 1

    def peak_while_running(self, run: str, other: str, other_tasks: int) -> int:
        """Most tasks of `run` at once as one of them started while both ran: after `other`'s first task started
        and before its last was done, whatever the time that took on a loaded machine. (Tasks of `run` started
        before `other` had any, when all the slots were its share, are counted while they last, but only a start
        sets the peak: what was dispatched before cannot be withdrawn.)"""
        now = peak = finished = 0
        other_started = False
        for run_id, step in self.timeline:
            other_started = other_started or run_id == other
            if run_id == other and step < 0:
                finished += 1
                if finished == other_tasks:
                    break
            if run_id == run:
                now += step
                if step > 0 and other_started:
                    peak = max(peak, now)
        return peak


async def test_a_slow_run_does_not_starve_another(engine, redis_client, start_controller):
    """Two runs share 4 rollout slots through one FIFO stream; one run's tasks take 5 s, the other's 0.05 s.
    Under ROLLOUT_CAPACITY each has at most its share (2) in flight while both run, so the fast run finishes
    while the slow one is still going (without it, the slow run's 30 tasks take every slot and sit ahead of
    every fast task for 40 s), and both make progress."""
    slow = add_run(engine, add_dataset(engine, 30), kind="eval", samples_per_task=1, max_in_flight=32)
    fast = add_run(engine, add_dataset(engine, 30), kind="eval", samples_per_task=1, max_in_flight=32)
    start_controller(ROLLOUT_CAPACITY="4")
    async with SlotWorker(redis_client, 4, {slow: 5.0, fast: 0.05}) as worker:
        # the deadline is slack for a loaded machine; the share itself is checked on the worker's timeline
        await wait_until_async(lambda: run_row(engine, fast).status == "completed", 90, "fast run done")
        assert worker.peak_while_running(slow, fast, 30) <= 2
        assert worker.done[slow] < 30
        await wait_until_async(lambda: worker.done[slow] >= 2, 15, "the slow run progressing")
        assert run_row(engine, slow).status == "running"


async def test_runs_share_the_slots_live_workers_advertise_by_default(engine, redis_client, start_controller):
    """Without ROLLOUT_CAPACITY the controller shares the MAX_CONCURRENCY that live rollout workers advertise in
    their heartbeats: the same slow and fast runs, and the fast one is not queued behind the slow one."""
    slow = add_run(engine, add_dataset(engine, 30), kind="eval", samples_per_task=1, max_in_flight=32)
    fast = add_run(engine, add_dataset(engine, 30), kind="eval", samples_per_task=1, max_in_flight=32)
    await redis_client.set(heartbeat_key("rollout-worker", "slots"), json.dumps({"max_concurrency": 4}), ex=120)
    start_controller()
    async with SlotWorker(redis_client, 4, {slow: 5.0, fast: 0.05}) as worker:
        await wait_until_async(lambda: run_row(engine, fast).status == "completed", 90, "fast run done")
        assert worker.peak_while_running(slow, fast, 30) <= 2
        assert worker.done[slow] < 30
        await wait_until_async(lambda: worker.done[slow] >= 2, 15, "the slow run progressing")
    await redis_client.delete(heartbeat_key("rollout-worker", "slots"))


# -- lifecycle ----------------------------------------------------------------------------------------------------
async def test_pause_stops_dispatch_resume_continues_stop_stops(engine, redis_client, start_controller):
    run = add_run(engine, add_dataset(engine, 40), kind="eval", samples_per_task=1, max_in_flight=2)
    start_controller()
    async with FakeRolloutWorker(redis_client, run, lambda t: "correct", hold_s=0.05) as worker:
        await wait_until_async(lambda: len(worker.received) >= 4, 30, "first dispatches")
        set_run(engine, run, status="paused")
        await asyncio.sleep(0.6)  # the controller reads the runs table every 0.2 s
        frozen = len(worker.received)
        await asyncio.sleep(1.0)
        assert len(worker.received) == frozen < 40
        set_run(engine, run, status="running")
        await wait_until_async(lambda: len(worker.received) >= frozen + 4, 30, "dispatch after resume")
        set_run(engine, run, status="stopping")
        await wait_until_async(lambda: run_row(engine, run).status == "stopped", 30, "stopped")
        count = len(worker.received)
        await asyncio.sleep(0.6)
        assert len(worker.received) == count < 40
    assert run_row(engine, run).finished_at is not None
    with engine.connect() as c:
        assert ledger_summary(c, run)["in_flight"] == 0


async def test_pause_resume_stop_through_the_api_reach_the_controller_as_commands(
        engine, redis_client, start_controller, database_url, redis_url, tmp_path):
    """The API's pause, resume and stop reach the controller on `run.control` and take effect at once: here it
    reads the runs table only every 20 s, so a change applied within seconds came as a command."""
    run = add_run(engine, add_dataset(engine, 40), kind="eval", samples_per_task=1, max_in_flight=2)
    with running_api(database_url, redis_url, tmp_path / "api", controller=False) as api, api.client() as client:
        start_controller(POLL_INTERVAL_S="20", RUN_LEASE_S="60")
        async with FakeRolloutWorker(redis_client, run, lambda t: "correct", hold_s=0.05) as worker:
            await wait_until_async(lambda: len(worker.received) >= 4, 30, "first dispatches")
            polled = time.monotonic()  # the run was taken at the controller's first poll, just before
            assert client.post(f"/v1/runs/{run}/pause").json()["status"] == "paused"
            await asyncio.sleep(0.6)
            frozen = len(worker.received)
            await asyncio.sleep(1.0)
            assert len(worker.received) == frozen < 40
            assert client.post(f"/v1/runs/{run}/resume").json()["status"] == "running"
            await wait_until_async(lambda: len(worker.received) >= frozen + 4, 5, "dispatch after resume")
            assert client.post(f"/v1/runs/{run}/stop").json()["status"] == "stopping"
            await wait_until_async(lambda: run_row(engine, run).status == "stopped", 5, "stopped")
            assert time.monotonic() - polled < 15, "too slow to tell commands from the next poll"
            count = len(worker.received)
            await asyncio.sleep(0.6)
            assert len(worker.received) == count < 40
    with engine.connect() as c:
        assert ledger_summary(c, run)["in_flight"] == 0


async def test_stop_cancels_in_flight_after_timeout(engine, redis_client, start_controller):
    run = add_run(engine, add_dataset(engine, 4), kind="eval", samples_per_task=1, max_in_flight=4)
    start_controller(STOP_TIMEOUT_S="0.5")
    async with FakeRolloutWorker(redis_client, run, lambda t: None) as worker:  # never answers
        await wait_until_async(lambda: len(worker.received) == 4, 30, "dispatch")
        set_run(engine, run, status="stopping")
        await wait_until_async(lambda: run_row(engine, run).status == "stopped", 30, "stopped")
    with engine.connect() as c:
        assert ledger_summary(c, run)["cancelled"] == 4
    assert events(engine, run, "cancelled") == [{"count": 4}]


async def test_stop_takes_back_the_tasks_no_worker_started(engine, redis_client, start_controller):
    """Stopped means no more work: tasks still queued in `rollout.tasks` when the run stops are deleted and
    cancelled at once (no wait for the stop timeout), and a worker that comes later gets none of them."""
    run = add_run(engine, add_dataset(engine, 6), kind="eval", samples_per_task=1, max_in_flight=6)

    def in_flight() -> int:
        with engine.connect() as c:
            return ledger_summary(c, run)["in_flight"]

    start_controller(STOP_TIMEOUT_S="60")
    await wait_until_async(lambda: in_flight() == 6, 30, "six tasks queued, no worker yet")
    set_run(engine, run, status="stopping")
    await wait_until_async(lambda: run_row(engine, run).status == "stopped", 10, "stopped at once")
    async with FakeRolloutWorker(redis_client, run, lambda t: "correct") as worker:
        await asyncio.sleep(1.0)
    assert worker.received == []
    with engine.connect() as c:
        assert ledger_summary(c, run)["cancelled"] == 6
    assert events(engine, run, "cancelled") == [{"count": 6, "queued": True}]


async def test_missing_dataset_fails_the_run(engine, redis_client, start_controller):
    run = add_run(engine, "no-such-dataset", kind="eval")
    start_controller()
    await wait_until_async(lambda: run_row(engine, run).status == "failed", 30, "failed")
    assert "no-such-dataset" in run_row(engine, run).error
    assert events(engine, run, "status_changed")[-1] == {"from": "pending", "to": "failed"}


# -- training: staleness window, ReMax ----------------------------------------------------------------------------
async def test_staleness_window_and_remax_greedy_samples(engine, redis_client, start_controller):
    run = add_run(engine, add_dataset(engine, 6), kind="train", samples_per_task=2, tasks_per_batch=2,
                  max_staleness=1, algorithm={"adv_estimator": "remax"})
    version = 0
    violations: list[tuple[int, int]] = []

    def answer(t: RolloutTask) -> str:
        if t.batch_idx - version > 1:
            violations.append((t.batch_idx, version))
        return "correct"

    start_controller()
    async with FakeRolloutWorker(redis_client, run, answer) as worker:
        await wait_until_async(lambda: len(worker.received) == 12, 30, "batches 0 and 1")
        await asyncio.sleep(0.6)
        assert {t.batch_idx for t in worker.received} == {0, 1}  # batch 2 waits for policy version 1
        version = 1
        set_run(engine, run, policy_version=1)
        await wait_until_async(lambda: len(worker.received) == 18, 30, "batch 2")
        assert run_row(engine, run).status == "running"
        set_run(engine, run, policy_version=3)
        await wait_until_async(lambda: run_row(engine, run).status == "completed", 30, "completed at version 3")
    assert not violations
    greedy = [t for t in worker.received if t.greedy]
    assert len(greedy) == 6 and all(t.sample_idx == 2 for t in greedy)
    assert sorted({t.task_id for t in worker.received}) == [f"t{i}" for i in range(6)]


async def test_what_the_trainer_never_read_is_replayed_when_redis_loses_its_data(engine, redis_client,
                                                                                start_controller):
    """Redis loses everything after the store accepted a batch: the accepted results the trainer never read
    (all groups but the one it reported consuming) are published again from Postgres, tokens intact."""
    run = add_run(engine, add_dataset(engine, 4), kind="train", samples_per_task=2, tasks_per_batch=2,
                  max_staleness=0, total_steps=2)
    start_controller()
    async with FakeRolloutWorker(redis_client, run, lambda t: "correct"):
        await wait_until_async(lambda: len(stored_keys(engine, run)) == 4, 30, "batch 0 stored")
    with engine.connect() as c:
        groups = c.execute(text("SELECT DISTINCT task_id FROM episodes WHERE run_id = :r ORDER BY 1"),
                           {"r": run}).scalars().all()
    consumed = ConsumedGroup(task_id=groups[0], batch_idx=0, status="used")
    await StreamBus(redis_client).publish(TRAINER_PROGRESS, TrainerProgress(run_id=run, version=0, groups=[consumed]))
    await wait_until_async(lambda: bool(engine.connect().execute(text(
        "SELECT 1 FROM consumed_groups WHERE run_id = :r"), {"r": run}).first()), 30, "the report applied")
    await redis_client.flushdb()

    async def replayed() -> list[AcceptedResult]:
        return [m for _, f in await redis_client.xrange(ACCEPTED_RESULTS) if (m := decode(f)).run_id == run]
    deadline = time.monotonic() + 15
    while len(got := await replayed()) < 2 and time.monotonic() < deadline:
        await asyncio.sleep(0.1)
    assert sorted((m.task_id, m.sample_idx) for m in got) == [(groups[1], 0), (groups[1], 1)]
    traj = got[0].result.trajectories[0]
    assert (traj.prompt_ids, traj.response_ids, traj.loss_mask, traj.reward) == ([1, 2], [3, 4], [1, 1], 1.0)
    assert traj.logprobs == pytest.approx([-0.1, -0.2])


# -- crash resume -------------------------------------------------------------------------------------------------
async def test_controller_sigkill_and_restart_loses_and_doubles_nothing(engine, redis_client, start_controller):
    run = add_run(engine, add_dataset(engine, 60), kind="eval", samples_per_task=2, max_in_flight=8)
    first = start_controller()
    async with FakeRolloutWorker(redis_client, run, lambda t: "correct", hold_s=0.2) as worker:
        await wait_until_async(lambda: len(stored_keys(engine, run)) >= 30, 30, "some results stored")
        first.send_signal(signal.SIGKILL)
        first.wait(10)
        killed_at = len(worker.received)
        start_controller()  # takes over once the dead controller's run lease expires
        await wait_until_async(lambda: run_row(engine, run).status == "completed", 30, "completed after restart")
    assert killed_at < 120
    keys = stored_keys(engine, run)
    assert sorted(keys) == sorted((f"t{i}", s) for i in range(60) for s in range(2))  # none lost, none doubled
    assert run_row(engine, run).summary["pass@k"]["1"] == 1.0


async def test_rows_a_dead_controller_committed_but_never_published_are_published_by_the_next(
        engine, redis_client, start_controller):
    """A controller killed between its ledger commit and its XADD left rows dispatched and their tasks nowhere;
    the controller that takes the run over publishes them at once (their lease, the run's 600 s trajectory
    timeout, is not waited out), each as the same attempt, and marks every row it published."""
    run = add_run(engine, add_dataset(engine, 6), kind="eval", samples_per_task=1, max_in_flight=8)
    with engine.begin() as c:  # what the dead controller committed: the run running, three rows, no XADD
        c.execute(text("UPDATE runs SET status = 'running' WHERE id = :r"), {"r": run})
        c.execute(text("""INSERT INTO rollout_tasks (run_id, task_id, sample_idx, attempt, status, batch_idx, epoch,
                                                     greedy, dispatch_version, lease_expires_at)
                          SELECT :r, 't' || i, 0, 0, 'dispatched', 0, 0, false, 0, now() + interval '600 seconds'
                          FROM generate_series(0, 2) AS i"""), {"r": run})
    start_controller()
    async with FakeRolloutWorker(redis_client, run, lambda t: "correct") as worker:
        await wait_until_async(lambda: run_row(engine, run).status == "completed", 30, "completed")
    assert sorted((t.task_id, t.attempt) for t in worker.received) == [(f"t{i}", 0) for i in range(6)]
    assert sorted(stored_keys(engine, run)) == [(f"t{i}", 0) for i in range(6)]
    assert events(engine, run, "lost") == []
    with engine.connect() as c:
        assert c.execute(text("SELECT count(*) FROM rollout_tasks WHERE run_id = :r AND published_at IS NULL"),
                         {"r": run}).scalar_one() == 0


# -- stalls: a running run that makes no progress says why -------------------------------------------------------
async def wait_stall(engine, run_id: str, prefix: str | None, timeout: float = 20.0) -> Run:
    what = f"stall_reason starting {prefix!r}"
    def holds() -> bool:
        reason = run_row(engine, run_id).stall_reason
        return reason is None if prefix is None else (reason or "").startswith(prefix)

    await wait_until_async(holds, timeout, what)
    return run_row(engine, run_id)


async def test_a_run_whose_units_are_slow_is_not_stalled_between_completions(engine, redis_client, start_controller):
    """Every unit takes ~3 s (a loaded machine) and STALL_AFTER_S is 1: once units have completed, the stall window
    is twice the unit time, so the run is not reported stalled while its slow batches complete."""
    run = add_run(engine, add_dataset(engine, 12), kind="eval", samples_per_task=1, max_in_flight=4)
    await redis_client.set(heartbeat_key("rollout-worker", "w"), json.dumps({"engines": ["hf"], "max_concurrency": 4,
                                                                             "inflight": 4}), px=120_000)
    await redis_client.set(heartbeat_key("env-worker", "e"), json.dumps({}), px=120_000)
    start_controller(STALL_AFTER_S="1")
    async with FakeRolloutWorker(redis_client, run, lambda t: "correct", hold_s=3.0):
        await wait_until_async(lambda: run_row(engine, run).status == "completed", 60, "run completed")
    stalled = [e["reason"] for e in events(engine, run, "stalled") if e.get("reason")]
    assert len(stalled) <= 1, stalled  # at most before the first batch measured how long a unit takes


async def test_a_stalled_run_says_why_each_reason_detected(engine, redis_client, start_controller):
    """No rollout worker, then none offering the run's engine, then no env worker, then paused: each detected from
    the workers' heartbeats after STALL_AFTER_S without progress; cleared once results flow."""
    run = add_run(engine, add_dataset(engine, 4), kind="eval", max_in_flight=4)
    with engine.begin() as c:  # `engine` is add_run's first argument: set the run's engine here
        c.execute(text("UPDATE runs SET config = config || CAST(:e AS jsonb) WHERE id = :r"),
                  {"r": run, "e": json.dumps({"engine": {"type": "openai", "base_url": "http://127.0.0.1:1/v1"}})})
    for key in [k async for k in redis_client.scan_iter(match="heartbeat:*")]:
        await redis_client.delete(key)
    start_controller(STALL_AFTER_S="1")
    row = await wait_stall(engine, run, "no live rollout worker (no rollout-worker heartbeat")
    assert row.status == "running" and row.stalled_since is not None
    await redis_client.set(heartbeat_key("rollout-worker", "w-hf"), json.dumps({"engines": ["hf"]}), px=60_000)
    await wait_stall(engine, run, "no live rollout worker offers engine 'openai' (the 1 live workers offer hf)")
    await redis_client.set(heartbeat_key("rollout-worker", "w-oa"), json.dumps({"engines": ["openai"]}), px=60_000)
    await wait_stall(engine, run, "no env worker alive")
    await redis_client.set(heartbeat_key("env-worker", "e1"), json.dumps({"sessions": 0}), px=60_000)
    await wait_stall(engine, run, "no attempt ended and no policy version for over 1s")  # the facts, no guess
    assert "4 tasks in flight" in run_row(engine, run).stall_reason
    set_run(engine, run, status="paused")
    await wait_stall(engine, run, "paused: resume it")
    reasons = [e["reason"] for e in events(engine, run, "stalled")]
    assert len(reasons) == 5 and reasons[0].startswith("no live rollout worker (")
    set_run(engine, run, status="running")
    async with FakeRolloutWorker(redis_client, run, lambda t: "correct"):
        await wait_until_async(lambda: run_row(engine, run).status == "completed", 30, "run completed")
    row = run_row(engine, run)
    assert row.stall_reason is None and row.stalled_since is None  # an ended run is not stalled


async def test_a_training_run_says_no_trainer_holds_it_then_that_the_window_waits_for_the_trainer(
        engine, redis_client, start_controller):
    run = add_run(engine, add_dataset(engine, 8), kind="train", samples_per_task=2, tasks_per_batch=2,
                  max_staleness=0, total_steps=3)
    await redis_client.set(heartbeat_key("rollout-worker", "w"), json.dumps({"engines": ["hf"]}), px=60_000)
    await redis_client.set(heartbeat_key("env-worker", "e"), json.dumps({}), px=60_000)
    start_controller(STALL_AFTER_S="1")
    async with FakeRolloutWorker(redis_client, run, lambda t: "correct") as worker:
        await wait_until_async(lambda: len(worker.received) == 4, 30, "the first batch")
        await wait_stall(engine, run, "no trainer trains this run (no live trainer lists it in its heartbeat): 4 results stored")
        # a trainer trains the run (its heartbeat lists it) but has not stepped yet
        await redis_client.set(heartbeat_key("trainer", "trainer-7"), json.dumps({"worker_id": "trainer-7",
                                                                                 "trains": [run]}), px=60_000)
        await wait_stall(engine, run, "staleness window full: groups up to policy version 0 + max_staleness 0")
        assert "trainer-7" in run_row(engine, run).stall_reason
        set_run(engine, run, policy_version=1)  # the trainer stepped: progress, and the window moves on
        await wait_stall(engine, run, None, timeout=5)
        await wait_until_async(lambda: len(worker.received) == 8, 30, "the second batch")


async def test_a_trainer_that_cannot_load_the_run_fails_it_with_the_loaders_reason(
        engine, redis_client, start_controller):
    run = add_run(engine, add_dataset(engine, 8), kind="train", samples_per_task=2, tasks_per_batch=2,
                  max_staleness=0, total_steps=3)
    await redis_client.set(heartbeat_key("rollout-worker", "w"), json.dumps({"engines": ["hf"]}), px=60_000)
    await redis_client.set(heartbeat_key("env-worker", "e"), json.dumps({}), px=60_000)
    start_controller()
    async with FakeRolloutWorker(redis_client, run, lambda t: "correct") as worker:
        await wait_until_async(lambda: len(worker.received) == 4, 30, "the first batch")
        # The trainer says so on trainer.progress (re-sent: one event all the same).
        cannot = TrainerProgress(run_id=run, version=0, error="OSError('no file named model.safetensors')")
        for _ in range(2):
            await redis_client.xadd(TRAINER_PROGRESS, encode(cannot))
        await wait_until_async(lambda: run_row(engine, run).status == "failed", 20, "run failed")
    assert run_row(engine, run).error == "the trainer cannot train this run: OSError('no file named model.safetensors')"
    with engine.connect() as c:
        recorded = c.execute(select(RunEvent.message).where(RunEvent.run_id == uuid.UUID(run),
                                                            RunEvent.kind == "trainer_error")).scalars().all()
    assert recorded == [cannot.error]


async def test_groups_without_learning_signal_for_versions_in_a_row_warn(engine, redis_client, start_controller):
    """The trainer's `groups_without_signal` metric at 1.0 (every advantage zero) for
    NO_SIGNAL_VERSIONS versions in a row puts a warning in the run's status; a version with signal clears it."""
    run = add_run(engine, add_dataset(engine, 4), kind="train", samples_per_task=2, tasks_per_batch=2,
                  total_steps=50)
    start_controller(NO_SIGNAL_VERSIONS="3")

    def report(version: int, value: float) -> None:
        with engine.begin() as c:
            c.execute(text("INSERT INTO metrics (run_id, name, step, value) VALUES (:r, 'groups_without_signal', "
                           ":v, :x)"), {"r": run, "v": version, "x": value})
        set_run(engine, run, policy_version=version)

    async with FakeRolloutWorker(redis_client, run, lambda t: "wrong"):
        await wait_until_async(lambda: run_row(engine, run).status == "running", 30, "running")
        report(1, 1.0)
        report(2, 1.0)
        await asyncio.sleep(1.0)
        assert run_row(engine, run).warning is None  # two versions: not yet
        report(3, 1.0)
        await wait_until_async(lambda: (run_row(engine, run).warning or "").startswith(
            "no learning signal: in each of the last 3 policy versions every advantage was zero"), 30, "the no-signal warning")
        assert len(events(engine, run, "warning")) == 1
        report(4, 0.5)
        await wait_until_async(lambda: run_row(engine, run).warning is None, 30, "the warning cleared")


async def test_failed_tracker_writes_are_a_warning_on_a_run_that_goes_on(engine, redis_client, start_controller):
    """The trainer's running count of failed tracker writes (`tracker_errors`) is the run's warning, beside any
    other, and the run keeps running: a tracker never fails or blocks a run."""
    run = add_run(engine, add_dataset(engine, 4), kind="train", samples_per_task=2, tasks_per_batch=2,
                  total_steps=50)
    start_controller(NO_SIGNAL_VERSIONS="2")

    def report(version: int, **values: float) -> None:
        with engine.begin() as c:
            for name, value in values.items():
                c.execute(text("INSERT INTO metrics (run_id, name, step, value) VALUES (:r, :n, :v, :x)"),
                          {"r": run, "n": name, "v": version, "x": value})
        set_run(engine, run, policy_version=version)

    async with FakeRolloutWorker(redis_client, run, lambda t: "wrong"):
        await wait_until_async(lambda: run_row(engine, run).status == "running", 30, "running")
        report(1, tracker_errors=0.0, groups_without_signal=0.0)
        await asyncio.sleep(1.0)
        assert run_row(engine, run).warning is None
        report(2, tracker_errors=3.0, groups_without_signal=1.0)
        await wait_until_async(lambda: (run_row(engine, run).warning or "").startswith(
            "trackers: 3 writes to this run's trackers"), 30, "the tracker warning")
        report(3, tracker_errors=3.0, groups_without_signal=1.0)  # and two versions without signal: both say so
        await wait_until_async(lambda: "no learning signal" in (run_row(engine, run).warning or ""), 30, "both")
        assert "trackers: 3 writes" in run_row(engine, run).warning
        assert run_row(engine, run).status == "running"


async def test_a_run_in_which_nothing_scored_fails_with_the_dominant_reason(engine, redis_client, start_controller):
    """No streak reaches a fail-fast threshold (the reasons differ), yet no unit scored: the run ends `failed`,
    never `completed`, naming the most common reason; errored units are final (never re-dispatched)."""
    run = add_run(engine, add_dataset(engine, 4), kind="eval", max_attempts=1)
    verdicts = {"t0": "failed", "t1": "error:env math.reset: KeyError: 'answer'",
                "t2": "error:env math.reset: KeyError: 'answer'", "t3": "error:agent A.update_from_model: TypeError: x"}
    start_controller()
    async with FakeRolloutWorker(redis_client, run, lambda t: verdicts[t.task_id]) as worker:
        await wait_until_async(lambda: run_row(engine, run).status in ("completed", "failed"), 30, "run ended")
    row = run_row(engine, run)
    assert row.status == "failed", row.error
    assert row.error == ("no unit produced a scored result (3 errored, 1 out of attempts); most common reason "
                         "(2 attempts, error): env math.reset: KeyError: 'answer'")
    assert len(worker.received) == 4  # nothing retried
    assert row.summary["scored"] == 0 and row.summary["errored"] == 3
    with engine.connect() as c:
        ledger = c.execute(text("SELECT units_errored, units_failed, attempts_errored FROM run_ledger "
                                "WHERE run_id = :r"), {"r": run}).one()
    assert tuple(ledger) == (3, 1, 3)


async def test_a_training_run_in_which_nothing_scores_fails_instead_of_running_forever(
        engine, redis_client, start_controller):
    """A training run's trainer never steps when nothing scores, so the run is never done; failed groups are
    refilled from later epochs and reasons that differ keep every fail-fast streak short. Once its first window
    of units all ended without a scored result, it fails with the most common reason."""
    run = add_run(engine, add_dataset(engine, 8), kind="train", samples_per_task=2, tasks_per_batch=2,
                  max_staleness=0, max_attempts=1, total_steps=5)
    start_controller()

    def verdict(t: RolloutTask) -> str:  # a reason of its own per unit: no streak reaches a threshold
        word = "abcdefgh"[int(t.task_id[1:])] * (t.sample_idx + 1)
        return f"error:env math.reset: KeyError: '{word}'" if t.sample_idx == 0 else "failed"

    async with FakeRolloutWorker(redis_client, run, verdict) as worker:
        await wait_until_async(lambda: run_row(engine, run).status in ("completed", "failed"), 30, "run ended")
    row = run_row(engine, run)
    assert row.status == "failed"
    assert row.error.startswith("no unit produced a scored result (2 errored, 2 out of attempts); most common "
                                "reason (2 attempts, failed): env session lost"), row.error
    assert len(worker.received) == 4  # the first window only: nothing re-dispatched or refilled after it


@pytest.mark.parametrize("api_skew_s", [-30, 30])
async def test_pause_and_stop_apply_within_a_second_on_hosts_whose_clocks_disagree(
        engine, redis_client, start_controller, database_url, redis_url, tmp_path, api_skew_s):
    """The API host's clock `api_skew_s` off, the controller's as much the other way (a minute apart): a pause,
    resume or stop is applied within a second. Commands expire by their age on Redis's clock (a 10 s wait is
    not 'expired' on a host a minute ahead), and run.control is ordered by runs.status_version, not by clocks
    (time faked per process: tests/support/skewed_clock)."""
    skewed = os.pathsep.join([str(REPO / "tests/support/skewed_clock"), os.environ["PYTHONPATH"]])
    run = add_run(engine, add_dataset(engine, 400), kind="eval", samples_per_task=1, max_in_flight=2)
    with running_api(database_url, redis_url, tmp_path / "api", controller=False, PYTHONPATH=skewed,
                     FAKE_CLOCK_SKEW_S=str(api_skew_s), RUN_COMMAND_WAIT_S="10") as api, api.client() as client:
        # it never polls the runs table within the test: what changes, changes by command
        start_controller(POLL_INTERVAL_S="60", RUN_LEASE_S="150", PYTHONPATH=skewed,
                         FAKE_CLOCK_SKEW_S=str(-api_skew_s))
        async with FakeRolloutWorker(redis_client, run, lambda t: "correct", hold_s=0.05) as worker:
            await wait_until_async(lambda: len(worker.received) >= 4, 30, "first dispatches")
            for _ in range(3):
                assert client.post(f"/v1/runs/{run}/pause").json()["status"] == "paused"
                await asyncio.sleep(1.0)
                frozen = len(worker.received)
                await asyncio.sleep(0.5)
                assert len(worker.received) == frozen, "a pause not applied within a second"
                assert client.post(f"/v1/runs/{run}/resume").json()["status"] == "running"
                await wait_until_async(lambda f=frozen: len(worker.received) >= f + 2, 5, "dispatch after resume")
            assert client.post(f"/v1/runs/{run}/stop").json()["status"] == "stopping"
            await wait_until_async(lambda: run_row(engine, run).status == "stopped", 1.5, "stopped")
            count = len(worker.received)
            await asyncio.sleep(0.6)
            assert len(worker.received) == count < 400
    assert run_row(engine, run).status_version == 9  # pending -> running, 3 x (pause, resume), stopping, stopped
