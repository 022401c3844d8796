"""A rollout worker does not run a task whose attempt's lease had expired when it was read (no result: the ledger
re-dispatches it); one it has read runs to its end, listed in the heartbeat so the controller renews its lease."""

from __future__ import annotations

import asyncio
import contextlib
import time
from types import SimpleNamespace

import pytest
from prometheus_client import REGISTRY

from services.rollout_worker.episodes import trajectory_budget
from services.rollout_worker.worker import RolloutWorker
from shared.contracts.messages import EpisodeResult, RolloutTask
from shared.platform.bus import Delivery


def task(lease_in_s: float | None, deadline_s: float = 100.0) -> RolloutTask:
    now = time.time()
    return RolloutTask(run_id="r", task_id="t", sample_idx=0, attempt=2, task={}, dispatched_at=now,
                       deadline_s=deadline_s, lease_expires_at=None if lease_in_s is None else now + lease_in_s)


def expired(when: str = "read") -> float:
    return REGISTRY.get_sample_value("rollout_tasks_expired_total", {"when": when}) or 0.0


class FakeConsumer:
    def __init__(self):
        self.acked: list[bytes] = []

    async def ack(self, deliveries):
        self.acked += [d.id for d in deliveries]


class NoRuns:
    def __init__(self):
        self.asked: list[str] = []

    async def get(self, run_id):
        self.asked.append(run_id)
        raise RuntimeError("no such run here")  # run_task then publishes a failed result


def worker() -> RolloutWorker:
    w = RolloutWorker.__new__(RolloutWorker)  # only what run_task touches
    w.worker_id, w.consumer, w.runs, w.published, w.ended = "w1", FakeConsumer(), NoRuns(), [], set()

    async def publish(result: EpisodeResult):
        w.published.append(result)

    w.publish = publish
    return w


async def test_an_expired_task_is_acked_and_not_run():
    w, before = worker(), expired()
    await w.run_task(Delivery(id=b"1-0", message=task(lease_in_s=-1.0), deliveries=1, fields={}))
    assert w.consumer.acked == [b"1-0"]
    assert w.runs.asked == [] and w.published == []  # no run looked up, no reply: the ledger re-dispatches it
    assert expired() == before + 1


@pytest.mark.parametrize("lease_in_s", [None, 5.0])
async def test_a_live_task_or_one_without_a_lease_is_run(lease_in_s):
    w, before = worker(), expired()
    await w.run_task(Delivery(id=b"2-0", message=task(lease_in_s), deliveries=1, fields={}))
    assert w.runs.asked == ["r"] and [r.task_id for r in w.published] == ["t"] and w.consumer.acked == [b"2-0"]
    assert expired() == before


class SlowProgram:
    """A run whose agent program outlives the lease."""

    def __init__(self, build_s: float = 0.0):
        self.build_s, self.asked, self.built, self.started = build_s, [], [], []
        self.config = SimpleNamespace(agent_program=SimpleNamespace(name="external"))

    def in_use(self):
        return contextlib.nullcontext()

    async def get(self, run_id):  # RunRegistry.get: the run's context, built on first use
        self.asked.append(run_id)
        await asyncio.sleep(self.build_s)
        self.built.append(run_id)
        return self

    async def run(self, ctx, task):  # AgentPrograms.run
        self.started.append(task.task_id)
        await asyncio.sleep(5)


def slow_worker(build_s: float = 0.0) -> RolloutWorker:
    w = worker()
    w.runs = w.programs = SlowProgram(build_s)
    return w


async def test_a_task_whose_lease_runs_out_while_it_runs_or_its_run_is_set_up_runs_to_its_end():
    """Once read, a task is the worker's: its heartbeat lists it and the controller renews its lease (a loaded
    machine makes trajectories slow, not lost)."""
    w, before = slow_worker(build_s=0.3), expired()
    w.programs.run = lambda ctx, t: asyncio.sleep(0.5, EpisodeResult(
        run_id="r", task_id="t", sample_idx=0, attempt=2, status="completed", termination_reason="env_done",
        task={}, worker_id="w1", started_at=time.time(), finished_at=time.time()))
    await w.run_task(Delivery(id=b"3-0", message=task(lease_in_s=0.2), deliveries=1, fields={}))
    assert w.runs.built == ["r"] and [r.task_id for r in w.published] == ["t"] and w.consumer.acked == [b"3-0"]
    assert expired() == before


async def test_the_heartbeat_lists_the_tasks_in_hand():
    w = worker()
    w.running, w.status = {}, {}
    slow = asyncio.create_task(asyncio.sleep(10))
    w.running[slow] = Delivery(id=b"5-0", message=task(5.0), deliveries=1, fields={})
    w._report()
    assert w.status["holds"] == [["r", "t", 0, 2]] and w.status["inflight"] == 1
    slow.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await slow
    w._finished(slow)
    assert w.status["holds"] == [] and w.status["inflight"] == 0


def test_budget_is_the_tasks_within_the_runs_and_not_cut_by_the_lease():
    # a queue wait must not turn into a TIMEOUT the env never caused: the lease does not shorten it
    ctx = SimpleNamespace(config=SimpleNamespace(trajectory_timeout_s=60.0))
    assert trajectory_budget(ctx, task(None, deadline_s=100.0)) == 60.0
    assert trajectory_budget(ctx, task(600.0, deadline_s=30.0)) == 30.0
    assert trajectory_budget(ctx, task(10.0)) == 60.0
