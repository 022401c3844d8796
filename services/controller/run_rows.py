"""A run's row (`runs`) and its `run_events` as the controller reads and writes them: the controller lease of
the runs it drives, the status (a compare-and-set), why the run stalls, its warning, its events.

Like the rest of the controller's Postgres side (ledger.py, run_commands.py, run_summary.py, trainer_groups.py,
dataset_rows.py): sync SQLAlchemy, run by callers in a thread. A function taking `db` (an Engine) is one
transaction of its own; one taking `conn` (a Connection) is a step of its caller's transaction. Every write is
conditional, so that a controller that lost its lease, or a concurrent API change, is never overwritten.

More: docs/architecture.md#the-ledger
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from sqlalchemy import Connection, Engine, Text, cast, exists, func, insert, literal, select, update
from sqlalchemy.dialects.postgresql import JSONB, UUID

from shared.contracts.db.models import Metric, Run, RunEvent
from shared.platform import leases

ACTIVE_STATUSES = ("pending", "running", "paused", "stopping")


@dataclass
class RunRow:
    id: str
    status: str
    config: dict
    policy_version: int
    status_version: int = 0


def lease_runs(db: Engine, owner: str, lease_s: float, limit: int) -> list[RunRow]:
    """Take or renew the controller lease (shared/platform/leases.py) of up to `limit` active runs, ours first, then the
    free or expired ones in creation order; returns the runs now held."""
    # Tinker runs are not driven: their work comes as Tinker operations (docs/tinker.md)
    active_runs = (select(cast(Run.id, Text)).where(Run.status.in_(ACTIVE_STATUSES), Run.kind != "tinker")
                   .order_by(Run.created_at))
    with db.begin() as conn:
        active = conn.execute(active_runs).scalars().all()
        held = leases.acquire(conn, leases.CONTROLLER, owner,
                              leases.free_or_ours(conn, leases.CONTROLLER, owner, active)[:limit], lease_s)
        rows = conn.execute(select(cast(Run.id, Text), Run.status, Run.config, Run.policy_version, Run.status_version)
                            .where(Run.id.in_(list(held)), Run.status.in_(ACTIVE_STATUSES))
                            .order_by(Run.created_at)).all()
    return [RunRow(*r) for r in rows]


def release_runs(db: Engine, owner: str) -> None:
    with db.begin() as conn:
        leases.release(conn, leases.CONTROLLER, owner)


def fail_run(db: Engine, run_id: str, old: str, error: str) -> bool:
    """A run that cannot start (its config or its dataset is unusable): failed, saying why."""
    with db.begin() as conn:
        return set_status(conn, run_id, old, "failed", error=error)


def set_status(conn: Connection, run_id: str, old: str, new: str, *, error: str | None = None,
               because: dict[str, Any] | None = None) -> bool:
    """Compare-and-set runs.status; stamps started_at / finished_at. False when someone changed it first.
    `because`: added to the `status_changed` event's data (the command that asked for it)."""
    ended = {"finished_at": func.now(), "stall_reason": None, "stalled_since": None}
    stamps = {"running": {"started_at": func.coalesce(Run.started_at, func.now())},
              **dict.fromkeys(("stopped", "completed", "failed"), ended)}
    done = conn.execute(update(Run).where(Run.id == run_id, Run.status == old).values(
        status=new, status_version=Run.status_version + 1, error=func.coalesce(error, Run.error),
        **stamps.get(new, {}))).rowcount == 1
    if done:
        add_event(conn, run_id, "status_changed", f"{old} -> {new}" + (f": {error}" if error else ""),
                  {"from": old, "to": new, **(because or {})})
    return done


def set_stall(db: Engine, run_id: str, reason: str | None) -> bool:
    """Record why the run is stalled (None: it progresses again); `stalled_since` keeps the first stall's time
    while the reason changes. A `stalled` event when a reason is set or changes. False when nothing changed."""
    with db.begin() as conn:
        changed = conn.execute(
            update(Run).where(Run.id == run_id, Run.stall_reason.is_distinct_from(reason))
            .values(stall_reason=reason, stalled_since=None if reason is None
                    else func.coalesce(Run.stalled_since, func.now()))).rowcount == 1
        if changed:
            add_event(conn, run_id, "stalled" if reason else "progressing", reason or "the run progresses again",
                      {"reason": reason})
    return changed


def no_signal_warning(conn: Connection, run_id: str, versions: int) -> str | None:
    """A warning when the trainer's last `versions` steps each had no group with learning signal (metric
    `groups_without_signal` 1.0: every advantage zero, as when each group's rewards are equal under GRPO), else
    None."""
    values = conn.execute(select(Metric.value).where(Metric.run_id == run_id, Metric.name == "groups_without_signal")
                          .order_by(Metric.step.desc()).limit(versions)).scalars().all()
    if len(values) < versions or any(v < 1.0 for v in values):
        return None
    return (f"no learning signal: in each of the last {versions} policy versions every advantage was zero (each "
            "group's rewards equal), so nothing was learned (metric groups_without_signal = 1.0). Check the reward "
            "function and that the task is within reach (reward > 0 sometimes); raise samples_per_task or the "
            "sampling temperature, or set algorithm.dynamic_sampling to skip such groups")


def tracker_warning(conn: Connection, run_id: str) -> str | None:
    """A warning when the trainer counted failed writes to the run's trackers (its metric `tracker_errors`, a
    running count), else None: a tracker never fails or blocks a run, so this is where its user hears of it."""
    errors = conn.execute(select(Metric.value).where(Metric.run_id == run_id, Metric.name == "tracker_errors")
                          .order_by(Metric.step.desc()).limit(1)).scalar()
    if not errors:
        return None
    return (f"trackers: {int(errors)} writes to this run's trackers (W&B, MLflow, TensorBoard) failed; training goes "
            "on without them. The trainer's log names the tracker and why (server down, credentials, package not "
            "installed): fix it in the run's `tracking` config or the trainer's TRACKING_* settings")


def update_run_warning(db: Engine, run_id: str, versions: int) -> str | None:
    """Set or clear the run's warning (`no_signal_warning` and `tracker_warning`, joined); returns it when it
    changed to a new warning."""
    with db.begin() as conn:
        warning = "; ".join(w for w in (no_signal_warning(conn, run_id, versions), tracker_warning(conn, run_id))
                            if w) or None
        changed = conn.execute(update(Run).where(Run.id == run_id, Run.warning.is_distinct_from(warning))
                               .values(warning=warning)).rowcount == 1
        if changed and warning:
            add_event(conn, run_id, "warning", warning, {})
    return warning if changed else None


def add_event(conn: Connection, run_id: str, kind: str, message: str, data: dict[str, Any],
              *, once: bool = False) -> None:
    """Append a run event; `once` skips it if an event of this kind with the same data exists (idempotent)."""
    row = select(literal(run_id, UUID), literal(kind), literal(message), literal(data, JSONB))
    if once:
        e = RunEvent
        row = row.where(~exists().where(e.run_id == run_id, e.kind == kind, e.data.contains(data)))
    conn.execute(insert(RunEvent).from_select(["run_id", "kind", "message", "data"], row))


def active_train_runs(db: Engine) -> list[str]:
    with db.connect() as conn:
        return list(conn.execute(select(cast(Run.id, Text))
                                 .where(Run.kind == "train", Run.status.in_(ACTIVE_STATUSES))).scalars())
