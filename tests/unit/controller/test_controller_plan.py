"""The dispatch plan and the per-run bookkeeping (pure: no Redis, no Postgres)."""

from __future__ import annotations

from services.controller.ledger import LedgerRow
from services.controller.plan import Plan
from services.controller.run_driver import RunDriver
from services.controller.run_rows import RunRow
from shared.contracts.run_config import RunConfig


def config(**kw) -> RunConfig:
    base = dict(name="r", model="m", dataset="d", agent={"name": "math"}, env={"name": "math"})
    return RunConfig.model_validate({**base, **kw})


def tasks(n: int) -> list[tuple[str, dict, str]]:
    return [(f"t{i}", {"i": i}, "src") for i in range(n)]


def test_eval_plan_is_every_task_times_samples():
    plan = Plan(config(kind="eval", samples_per_task=3), [f"t{i}" for i in range(4)])
    slots = plan.batch(0)
    assert {(s.task_id, s.sample_idx) for s in slots} == {(f"t{i}", s) for i in range(4) for s in range(3)}
    assert plan.group_limit(0) == 4 and plan.num_batches == 1
    assert plan.group_index(1, 0) >= plan.group_limit(0)  # nothing past batch 0


def test_train_plan_epochs_cover_each_task_once_and_are_seeded():
    cfg = config(samples_per_task=2, tasks_per_batch=3, epochs=2, seed=7)
    plan = Plan(cfg, [f"t{i}" for i in range(7)])
    assert plan.batches_per_epoch == 3 and plan.planned_steps == 6
    for epoch in range(2):
        slots = [s for b in range(epoch * 3, epoch * 3 + 3) for s in plan.batch(b)]
        assert sorted({s.task_id for s in slots}) == sorted(f"t{i}" for i in range(7))
        assert len(slots) == 7 * 2 and {s.epoch for s in slots} == {epoch}
        assert {s.sample_idx for s in slots} == {epoch * 2, epoch * 2 + 1}  # unique across epochs
    again = Plan(cfg, [f"t{i}" for i in range(7)])
    assert [again.batch(b) for b in range(6)] == [plan.batch(b) for b in range(6)]
    other = Plan(config(samples_per_task=2, tasks_per_batch=3, epochs=2, seed=8), [f"t{i}" for i in range(7)])
    assert [other.batch(b) for b in range(6)] != [plan.batch(b) for b in range(6)]


def test_total_steps_overrides_epochs_and_window_follows_staleness():
    plan = Plan(config(samples_per_task=2, tasks_per_batch=2, total_steps=5, max_staleness=2), ["a", "b"])
    assert plan.planned_steps == 5 and plan.batch(4)[0].epoch == 4
    assert [plan.group_limit(v) for v in (0, 1, 3, 9)] == [6, 8, 10, 10]  # groups: 2 per batch, capped at 5 steps


def test_remax_adds_one_greedy_sample_per_task():
    plan = Plan(config(samples_per_task=2, tasks_per_batch=2, algorithm={"adv_estimator": "remax"}), ["a", "b"])
    slots = plan.batch(0)
    greedy = [s for s in slots if s.greedy]
    assert len(slots) == 6 and {(s.task_id, s.sample_idx) for s in greedy} == {("a", 2), ("b", 2)}


def test_driver_respects_in_flight_limit_and_window():
    driver = RunDriver(RunRow("r1", "running", {}, 0), config(samples_per_task=2, tasks_per_batch=2,
                                                             max_staleness=0, max_in_flight=4), tasks(4))
    first = driver.next_items(10)
    assert {s.batch_idx for s, _ in first} == {0} and len(first) == 4  # batch 1 waits for version 1
    driver.mark_dispatched(first, {(s.task_id, s.sample_idx, a) for s, a in first})
    assert driver.next_items(10) == [] and len(driver.in_flight) == 4
    driver.policy_version = 1
    assert {s.batch_idx for s, _ in driver.next_items(10)} == {1}


def test_driver_rebuild_retries_lost_and_stops_at_max_attempts():
    cfg = config(kind="eval", samples_per_task=1, max_attempts=2)
    rows = [
        LedgerRow("t0", 0, 0, "completed", 0, 0, False),
        LedgerRow("t1", 0, 0, "lost", 0, 0, False),
        LedgerRow("t2", 0, 0, "failed", 0, 0, False), LedgerRow("t2", 0, 1, "failed", 0, 0, False),
        LedgerRow("t3", 0, 0, "dispatched", 0, 0, False),
    ]
    driver = RunDriver(RunRow("r1", "running", {}, 0), cfg, tasks(5))
    driver.rebuild(rows)
    assert driver.num_completed == 1 and driver.final_failed == {("t2", 0)} and driver.in_flight == {("t3", 0)}
    items = [(s.task_id, s.sample_idx, a) for s, a in driver.next_items(10)]
    assert items == [("t1", 0, 1), ("t4", 0, 0)]  # the lost one as attempt 1, the never-dispatched one fresh
    assert not driver.is_done
    driver.mark_dispatched(driver_items := [(driver.states[("t1", 0)].slot, 1)], {("t1", 0, 1)})
    assert driver_items and driver.apply("t1", 0, 1, "lost") is True  # second bad attempt: final
    assert driver.apply("t3", 0, 0, "completed") is False and driver.apply("t3", 0, 0, "completed") is False
    assert driver.num_completed == 2


def _dispatch_all(driver: RunDriver) -> list:
    items = driver.next_items(10_000)
    driver.mark_dispatched(items, {(s.task_id, s.sample_idx, a) for s, a in items})
    return items


def _groups(items) -> set[tuple[str, int]]:
    return {(s.task_id, s.epoch) for s, _ in items}


def test_dropped_groups_widen_the_window_past_the_planned_batches():
    cfg = config(samples_per_task=2, tasks_per_batch=2, total_steps=2, max_staleness=0, max_in_flight=10_000)
    driver = RunDriver(RunRow("r1", "running", {}, 0), cfg, tasks(3))
    first = _dispatch_all(driver)
    assert len(_groups(first)) == 2 and {s.batch_idx for s, _ in first} == {0}
    driver.dropped_groups = 1  # the trainer dropped one group of batch 0: one more group, from batch 1
    refill = _dispatch_all(driver)
    assert len(_groups(refill)) == 1 and {s.batch_idx for s, _ in refill} == {1}
    driver.policy_version, driver.dropped_groups = 1, 4  # at the last planned step, 4 groups dropped so far
    more = _dispatch_all(driver)
    assert len(_groups(first + refill + more)) == 2 * 2 + 4 and not driver.is_done  # both steps + the drops
    assert max(s.batch_idx for s, _ in more) >= driver.plan.num_batches  # past the plan: epoch 1, 2, ...
    assert {s.epoch for s, _ in more} >= {1}
    driver.policy_version = 2
    assert driver.is_done  # done at the planned steps, however many groups were dispatched


def test_plan_continues_past_num_batches_with_the_seeded_epochs():
    cfg = config(samples_per_task=2, tasks_per_batch=2, epochs=1, seed=3)
    plan = Plan(cfg, [f"t{i}" for i in range(4)])
    assert plan.num_batches == 2
    later = [s for b in (2, 3) for s in plan.batch(b)]
    assert sorted({s.task_id for s in later}) == [f"t{i}" for i in range(4)]  # epoch 1: every task once more
    assert {s.epoch for s in later} == {1} and {s.sample_idx for s in later} == {2, 3}
    assert Plan(cfg, [f"t{i}" for i in range(4)]).batch(3) == plan.batch(3)


def test_window_never_runs_more_than_max_staleness_ahead_of_what_was_consumed():
    for staleness in (0, 1, 3):
        cfg = config(samples_per_task=2, tasks_per_batch=3, total_steps=6, max_staleness=staleness,
                     max_in_flight=10_000)
        driver = RunDriver(RunRow("r1", "running", {}, 0), cfg, tasks(5))  # 5 tasks: epochs split unevenly
        dispatched: set[tuple[str, int]] = set()
        for version, dropped in [(0, 0), (0, 1), (0, 2), (1, 2), (1, 7), (2, 7), (4, 9), (5, 9), (6, 9)]:
            driver.policy_version, driver.dropped_groups = version, dropped
            dispatched |= _groups(_dispatch_all(driver))
            consumed = version * 3 + dropped  # groups the trainer used or dropped
            need = min(version + staleness + 1, 6) * 3 + dropped  # what the trainer may ask for in the window
            assert len(dispatched) == need  # enough to never starve ...
            assert len(dispatched) - consumed <= (staleness + 1) * 3  # ... and never further ahead


def test_uneven_epochs_still_dispatch_enough_groups_for_the_planned_steps():
    cfg = config(samples_per_task=2, tasks_per_batch=3, epochs=2, max_staleness=0, max_in_flight=10_000)
    driver = RunDriver(RunRow("r1", "running", {}, 0), cfg, tasks(7))
    assert driver.plan.planned_steps == 6  # 3 batches of 3, 3, 1 tasks per epoch
    dispatched = set()
    for version in range(6):
        driver.policy_version = version
        dispatched |= _groups(_dispatch_all(driver))
        assert len(dispatched) == (version + 1) * 3  # whole steps' worth, the last one from epoch 2


def test_attempts_failing_for_one_reason_in_a_row_fail_the_run_and_a_success_resets_the_count():
    cfg = config(kind="eval", samples_per_task=1, max_attempts=5, max_in_flight=4, fail_fast_after=3)
    driver = RunDriver(RunRow("r1", "running", {}, 0), cfg, tasks(8))
    driver.mark_dispatched(*(lambda items: (items, {(s.task_id, s.sample_idx, a) for s, a in items}))(
        driver.next_items(8)))
    boom = "Traceback (most recent call last):\n  ...\nOSError: model path /m/0x7f3a does not exist\n"
    driver.apply("t0", 0, 0, "failed", boom)
    driver.apply("t1", 0, 0, "lost", "no result before the task lease expired")  # another reason
    driver.apply("t2", 0, 0, "failed", boom.replace("0x7f3a", "0x11"))  # same reason, another address
    assert driver.fail_reason is None
    driver.apply("t3", 0, 0, "completed")  # a success: every streak starts over
    driver.apply("t0", 0, 0, "failed", boom)  # not live any more: ignored
    assert driver.fail_reason is None and driver.failure_streak == {}
    for s in driver.states.values():
        s.status = "dispatched"
    for t in ("t0", "t1", "t2"):
        driver.apply(t, 0, 0, "failed", boom)
    assert driver.fail_reason == "3 attempts in a row failed: OSError: model path /m/0x7f3a does not exist"
    def threshold(n_tasks: int, max_in_flight: int) -> int:
        cfg = config(kind="eval", samples_per_task=1, max_in_flight=max_in_flight)
        return RunDriver(RunRow("r2", "running", {}, 0), cfg, tasks(n_tasks)).fail_fast_failures

    assert (threshold(500, 4), threshold(500, 64), threshold(40, 64)) == (20, 128, 40)  # capped by the run's size


def test_lost_attempts_neither_fail_the_run_fast_nor_reset_a_streak():
    """A lease that expired says its workers died or Redis lost the task, not that the run is broken."""
    cfg = config(kind="eval", samples_per_task=1, max_attempts=9, max_in_flight=8, fail_fast_after=3)
    driver = RunDriver(RunRow("r1", "running", {}, 0), cfg, tasks(8))
    driver.mark_dispatched(*(lambda items: (items, {(s.task_id, s.sample_idx, a) for s, a in items}))(
        driver.next_items(8)))
    for t in ("t0", "t1", "t2", "t3", "t4"):
        driver.apply(t, 0, 0, "lost", "no result before the task lease expired")
    assert driver.fail_reason is None and driver.failure_streak == {}
    driver.apply("t5", 0, 0, "failed", "ValueError: bad")
    driver.apply("t6", 0, 0, "lost", "no result before the task lease expired")
    driver.apply("t7", 0, 0, "failed", "ValueError: bad")
    assert driver.failure_streak == {"ValueError: bad": 2}


def test_rollout_capacity_is_shared_by_priority_and_what_a_run_cannot_use_goes_to_the_others():
    from services.controller.share import fair_shares

    assert fair_shares(8, {"a": (1.0, 256), "b": (1.0, 256)}) == {"a": 4, "b": 4}
    assert fair_shares(8, {"a": (3.0, 256), "b": (1.0, 256)}) == {"a": 6, "b": 2}
    assert fair_shares(10, {"small": (1.0, 2), "b": (1.0, 256), "c": (2.0, 256)}) == {"small": 2, "b": 2, "c": 5}
    assert fair_shares(2, {r: (1.0, 8) for r in "abc"}) == {"a": 1, "b": 1, "c": 1}  # every run progresses


def _dispatch(driver: RunDriver, n: int) -> list:
    items = driver.next_items(n)
    driver.mark_dispatched(items, {(s.task_id, s.sample_idx, a) for s, a in items})
    return items


def test_fail_fast_scales_with_a_small_run():
    """40 units whose first attempts all fail the same way fail the run after those 40, not after 512."""
    driver = RunDriver(RunRow("r1", "running", {}, 0), config(kind="eval", max_in_flight=256), tasks(40))
    assert driver.fail_fast_failures == 40 and driver.fail_fast_errors == 10
    _dispatch(driver, 40)
    for i in range(39):
        driver.apply(f"t{i}", 0, 0, "failed", "Traceback ...\nOSError: config.json is not valid JSON")
    assert driver.fail_reason is None
    driver.apply("t39", 0, 0, "failed", "Traceback ...\nOSError: config.json is not valid JSON")
    assert driver.fail_reason == "40 attempts in a row failed: OSError: config.json is not valid JSON"
    big = RunDriver(RunRow("r2", "running", {}, 0), config(kind="eval", max_in_flight=256), tasks(4000))
    assert big.fail_fast_failures == 512  # max(20, 2 * max_in_flight) where the run is larger than that


def test_errored_units_are_final_counted_apart_and_fail_fast_on_their_own_threshold():
    cfg = config(kind="eval", max_in_flight=64, fail_fast_after_errors=3)
    driver = RunDriver(RunRow("r1", "running", {}, 0), cfg, tasks(6))
    _dispatch(driver, 6)
    where = "env math.reset: RuntimeError: boom"
    assert driver.apply("t0", 0, 0, "error", where) is True  # final: its group can never complete
    driver.apply("t1", 0, 0, "completed")
    assert driver.apply("t2", 0, 0, "error", where) and driver.apply("t3", 0, 0, "error", where + "\ntraceback")
    assert driver.fail_reason is None  # the completed unit reset the streak: 2 in a row
    assert driver.num_errored == 3 and driver.num_completed == 1 and not driver.retry and not driver.final_failed
    driver.apply("t4", 0, 0, "error", where)
    assert driver.fail_reason == "3 units in a row ended in a user-code error: env math.reset: RuntimeError: boom"
    driver.apply("t5", 0, 0, "completed")
    assert driver.is_done  # scored + errored + out of attempts = every unit
    rebuilt = RunDriver(RunRow("r1", "running", {}, 0), cfg, tasks(6))
    rebuilt.rebuild([LedgerRow(f"t{i}", 0, 0, "error" if i in (0, 2, 3, 4) else "completed", 0, 0, False)
                     for i in range(6)])
    assert rebuilt.num_errored == 4 and rebuilt.num_completed == 2 and rebuilt.is_done


def test_train_errored_slot_counts_as_a_group_that_cannot_complete():
    cfg = config(samples_per_task=2, tasks_per_batch=2, max_in_flight=8)
    driver = RunDriver(RunRow("r1", "running", {}, 0), cfg, tasks(4))
    items = _dispatch(driver, 8)
    s = items[0][0]
    driver.apply(s.task_id, s.sample_idx, 0, "error", "agent A.update_from_model: TypeError: x")
    assert driver.final_failed_groups() == [(s.task_id, s.batch_idx)]


def test_run_control_is_ordered_by_status_version_not_by_who_sent_it_when():
    """Whatever the `sent_at` of the controller that applied a command (its clock), the driving controller
    applies a run.control message only if its status_version is above what it read or applied last."""
    import asyncio
    from types import SimpleNamespace

    from services.controller.control_loop import ControlLoop
    from shared.contracts.messages import RunControl

    driver = RunDriver(RunRow("r1", "running", {}, 0, status_version=4), config(kind="eval"), tasks(2))
    wake = asyncio.Event()
    loop = ControlLoop(SimpleNamespace(redis=None), {"r1": driver}, wake)
    loop.apply([RunControl(run_id="r1", action="pause", sent_at=0.0, status_version=4)])  # what the table said
    assert driver.status == "running" and not wake.is_set()
    loop.apply([RunControl(run_id="r1", action="pause", sent_at=0.0, status_version=5),  # a clock far behind
                RunControl(run_id="r2", action="stop", sent_at=9e9, status_version=99)])  # not driven here
    assert (driver.status, driver.status_version) == ("paused", 5) and wake.is_set()
    loop.apply([RunControl(run_id="r1", action="resume", sent_at=9e9, status_version=3)])  # read late: older
    assert driver.status == "paused"
    loop.apply([RunControl(run_id="r1", action="resume", sent_at=1.0, status_version=6)])
    assert (driver.status, driver.status_version) == ("running", 6)
