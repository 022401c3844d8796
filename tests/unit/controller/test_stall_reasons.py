"""Why a stalled run makes no progress (services/controller/stall.py), from the facts the controller gathers."""

from __future__ import annotations

from services.controller.run_driver import RunDriver
from services.controller.run_rows import RunRow
from services.controller.stall import Facts, stall_reason
from shared.contracts.run_config import RunConfig
from shared.platform.heartbeats import Heartbeat


def driver(**kw) -> RunDriver:
    base = dict(name="r", model="m", dataset="d", agent={"name": "math"}, env={"name": "math"})
    cfg = RunConfig.model_validate({**base, **kw})
    return RunDriver(RunRow("r1", "running", {}, 0), cfg, [(f"t{i}", {}, "") for i in range(4)])


HF = Heartbeat(engines=["hf", "openai"])


def test_work_waiting_names_the_missing_worker():
    d = driver(kind="eval")
    assert stall_reason(d, Facts(redis_error="ConnectionError()"), 90).startswith("Redis unreachable")
    assert stall_reason(d, Facts(env_workers=1), 90).startswith("no live rollout worker (")
    vllm = driver(kind="eval", engine={"type": "vllm"})
    assert stall_reason(vllm, Facts(rollout_workers=[HF], env_workers=1), 90).startswith(
        "no live rollout worker offers engine 'vllm' (the 1 live workers offer hf, openai)")
    assert stall_reason(d, Facts(rollout_workers=[HF]), 90).startswith("no env worker alive")
    full = Heartbeat(engines=["hf"], max_concurrency=4, inflight=4)
    assert stall_reason(d, Facts(rollout_workers=[full, full], env_workers=1), 90).startswith(
        "every rollout slot is busy (8 of the 8 slots of 2 live workers)")
    free = full.model_copy(update={"inflight": 1})
    assert "(5 of 8 slots busy)" in stall_reason(d, Facts(rollout_workers=[full, free], env_workers=1), 90)
    program = driver(kind="eval", agent_program={"name": "external"})
    assert not stall_reason(program, Facts(rollout_workers=[HF]), 90).startswith("no env worker")


def test_nothing_to_dispatch_names_the_trainer():
    d = driver(samples_per_task=2, tasks_per_batch=2, max_in_flight=8)
    items = d.next_items(8)
    d.mark_dispatched(items, {(s.task_id, s.sample_idx, a) for s, a in items})
    for s, a in items:
        d.apply(s.task_id, s.sample_idx, a, "completed")
    facts = Facts(rollout_workers=[HF], env_workers=1)
    assert not d.has_undispatched()
    assert stall_reason(d, facts, 90).startswith("no trainer trains this run")
    facts.trainers = [Heartbeat(worker_id="trainer-2", trains=["another run"])]
    assert stall_reason(d, facts, 90).startswith("no trainer trains this run")  # its heartbeat lists other runs
    facts.trainers.append(Heartbeat(worker_id="trainer-1", trains=[d.run_id]))
    assert stall_reason(d, facts, 90).startswith("staleness window full") and "(trainer-1)" in stall_reason(d, facts, 90)
    d.policy_version = 1  # the trainer stepped: the window moves on
    assert d.has_undispatched()
