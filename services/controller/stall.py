"""Why a running run makes no progress, from what the controller can see (never a guess): the live workers'
heartbeats in Redis and the run's own dispatch state.

    facts = await gather_facts(redis)                        # in DispatchLoop.check_stalls (dispatch.py)
    reason = stall_reason(driver, facts, stall_after_s)      # a sentence for runs.stall_reason

Checked in a fixed order, the first that holds is the reason. Paused runs say so at once; Redis or Postgres
unreachable is the controller's own error, reported as such.

More: docs/architecture.md#stall-reasons
"""

from __future__ import annotations

from dataclasses import dataclass, field

from services.controller.run_driver import RunDriver
from shared.platform.bus import Redis, RedisError
from shared.platform.heartbeats import Heartbeat, live_workers_async


@dataclass
class Facts:
    rollout_workers: list[Heartbeat] = field(default_factory=list)  # each live rollout worker's heartbeat
    env_workers: int = 0  # live env workers
    trainers: list[Heartbeat] = field(default_factory=list)  # each live trainer's heartbeat
    redis_error: str | None = None  # Redis could not be read


async def gather_facts(redis: Redis) -> Facts:
    """The live workers' heartbeats."""
    facts = Facts()
    try:
        facts.rollout_workers = [b for b in await live_workers_async(redis, "rollout-worker") if not b.stopping]
        facts.env_workers = sum(not b.stopping for b in await live_workers_async(redis, "env-worker"))
        facts.trainers = await live_workers_async(redis, "trainer")
    except RedisError as e:
        facts.redis_error = repr(e)
    return facts


def stall_reason(d: RunDriver, facts: Facts, stall_after_s: float) -> str:
    """The reason, worded the same while the facts stay the same (a new wording is a new `stalled` event); how
    long the run has been stalled is `runs.stalled_since`."""
    idle = f"no attempt ended and no policy version for over {stall_after_s:g}s"
    if facts.redis_error:
        return f"Redis unreachable ({facts.redis_error}): tasks cannot be dispatched nor results read; {idle}"
    waiting = len(d.in_flight) + len(d.retry)
    if waiting or d.has_undispatched():
        what = f"{len(d.in_flight)} tasks in flight, {len(d.retry)} to retry"
        if not facts.rollout_workers:
            return (f"no live rollout worker (no rollout-worker heartbeat in Redis): {what}; start one "
                    "(docker compose up -d rollout-worker)")
        engine = d.cfg.engine.type
        offered = sorted({e for w in facts.rollout_workers for e in (w.engines or [])})
        advertised = [w for w in facts.rollout_workers if w.engines is not None]
        if advertised and engine not in offered:
            return (f"no live rollout worker offers engine {engine!r} (the {len(advertised)} live workers offer "
                    f"{', '.join(offered) or 'none'}): {what}; start a worker with it or change engine.type")
        if d.cfg.agent_program is None and facts.env_workers == 0:
            return (f"no env worker alive (no env-worker heartbeat in Redis): {what}; start one "
                    "(docker compose up -d env-worker)")
        slots = sum(w.max_concurrency for w in facts.rollout_workers)
        busy = sum(w.inflight for w in facts.rollout_workers)
        if slots and busy >= slots:
            return (f"every rollout slot is busy ({busy} of the {slots} slots of {len(facts.rollout_workers)} live "
                    f"workers): {what}; add rollout workers or MAX_CONCURRENCY, or lower other runs' priority")
        return (f"{idle} with {what} on {len(facts.rollout_workers)} live rollout workers ({busy} of {slots} slots "
                "busy): the trajectories are running; see the rollout workers' logs")
    if d.plan.is_eval:
        return f"{idle} and nothing left to dispatch"
    trainer = next((t.worker_id for t in facts.trainers if d.run_id in t.trains), None)
    if trainer is None and d.trainer_error is not None:
        return (f"the trainer cannot train this run ({d.trainer_error[:300]}): {d.num_completed} results stored, "
                "none trained on since; fix the model or checkpoint, then restart the trainer (it does not try a "
                "run that failed to load again until it restarts)")
    if trainer is None:
        return (f"no trainer trains this run (no live trainer lists it in its heartbeat): {d.num_completed} "
                "results stored, none trained on since; start the trainer (docker compose up -d trainer)")
    return (f"staleness window full: groups up to policy version {d.policy_version} + max_staleness "
            f"{d.cfg.max_staleness} are dispatched and ended; waiting for the trainer ({trainer}) to step")
