"""The controller's Postgres side (the trajectory rows themselves are store.py's): `runs` and its leases,
`dataset_rows`, the ledger (`rollout_tasks`, one row per dispatched attempt) and `consumed_groups`. Sync
SQLAlchemy; callers run these in a thread.

A function taking `db` (an Engine) is one transaction of its own; one taking `conn` (a Connection) is a step
of its caller's transaction. Every write is conditional (compare-and-set on the status it expects) so that a
controller that lost its lease, or a concurrent API change, is never overwritten.

More: docs/architecture.md#the-ledger
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from pydantic import ValidationError
from sqlalchemy import (
    Connection,
    Engine,
    Integer,
    Text,
    and_,
    cast,
    exists,
    func,
    insert,
    literal,
    select,
    text,
    update,
)
from sqlalchemy.dialects.postgresql import JSONB, UUID
from sqlalchemy.orm import aliased

from services.controller.plan import Slot
from shared.clients.run_commands import command_applied
from shared.contracts.db.models import (
    ConsumedGroupRow,
    Dataset,
    DatasetRow,
    EpisodeRow,
    Metric,
    RolloutTaskRow,
    Run,
    RunEvent,
)
from shared.contracts.messages import RunCommand, RunCommandReply, TrainerProgress
from shared.contracts.messages.control import TRANSITIONS
from shared.contracts.run_config import RunConfig
from shared.contracts.tinker_run import TinkerRunConfig
from shared.platform import leases

ACTIVE_STATUSES = ("pending", "running", "paused", "stopping")
LEDGER_ROW_STATUSES = ("dispatched", "completed", "error", "failed", "lost", "cancelled")


@dataclass
class RunRow:
    id: str
    status: str
    config: dict
    policy_version: int
    status_version: int = 0


@dataclass
class LedgerRow:
    task_id: str
    sample_idx: int
    attempt: int
    status: str
    batch_idx: int
    epoch: int
    greedy: bool


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


def apply_command(db: Engine, cmd: RunCommand, expired: bool) -> RunCommandReply:
    """One run command in one transaction, under the run's row lock (shared/contracts/messages/control.py). Idempotent by
    command id (shared/clients/run_commands.py command_applied): one applied before (a redelivery) is answered `applied` again
    and changes nothing; one not yet applied and `expired` is not applied."""
    with db.begin() as conn:
        status, kind = conn.execute(select(Run.status, Run.kind).where(Run.id == cmd.run_id).with_for_update()).first() \
            or (None, None)
        if status is not None and command_applied(conn, cmd):
            return _reply(cmd, "applied", status)
        if status is None and cmd.action != "create":
            return _reply(cmd, "not_found", None, f"run {cmd.run_id} does not exist")
        if expired:
            return _reply(cmd, "expired", status, "read after its sender stopped waiting; not applied")
        if cmd.action == "create":
            return create_run(conn, cmd)
        allowed, new = TRANSITIONS[cmd.action]
        if kind == "tinker":  # not driven: nothing to drain on a stop, and only its client pauses its work
            if cmd.action != "stop":
                return _reply(cmd, "refused", status, f"a tinker run cannot {cmd.action}: its Tinker client drives it")
            new = "stopped"
        if status not in allowed:
            return _reply(cmd, "refused", status, f"cannot {cmd.action} a run that is {status}; {cmd.action} "
                                                  f"needs status {' or '.join(allowed)}")
        set_status(conn, cmd.run_id, status, new, because={"command": cmd.command_id, "action": cmd.action})
        version = conn.execute(select(Run.status_version).where(Run.id == cmd.run_id)).scalar()
        return _reply(cmd, "applied", new).model_copy(update={"status_version": version})


def create_run(conn: Connection, cmd: RunCommand) -> RunCommandReply:
    """The run of a `create` command, `pending`, with its `created` event; refused when its config is not a
    valid run config (the sender checked it; this guards against a producer that did not). A Tinker run
    (shared/contracts/tinker_run.py) is stored `running`: its client is already at work."""
    if (cmd.config or {}).get("kind") == "tinker":
        return _create_tinker_run(conn, cmd)
    try:
        cfg = RunConfig.model_validate(cmd.config or {})
    except ValidationError as e:
        return _reply(cmd, "refused", None, f"not a valid run config: {e}")
    conn.execute(insert(Run).values(id=cmd.run_id, name=cfg.name, kind=cfg.kind, status="pending",
                                    config=cfg.model_dump(mode="json"), policy_version=0, summary={}))
    by = f" by {cmd.created_by}" if cmd.created_by else ""
    add_event(conn, cmd.run_id, "created", f"{cfg.kind} run created{by}",
              {"rows": cmd.rows, "command": cmd.command_id})
    return _reply(cmd, "applied", "pending")


def _create_tinker_run(conn: Connection, cmd: RunCommand) -> RunCommandReply:
    try:
        cfg = TinkerRunConfig.model_validate(cmd.config)
    except ValidationError as e:
        return _reply(cmd, "refused", None, f"not a valid tinker run config: {e}")
    conn.execute(insert(Run).values(id=cmd.run_id, name=cfg.name, kind="tinker", status="running",
                                    started_at=func.now(), config=cfg.model_dump(mode="json"), policy_version=0,
                                    summary={}))
    by = f" by {cmd.created_by}" if cmd.created_by else ""
    add_event(conn, cmd.run_id, "created", f"tinker run created{by}", {"command": cmd.command_id})
    return _reply(cmd, "applied", "running")


def _reply(cmd: RunCommand, outcome: str, status: str | None, message: str = "") -> RunCommandReply:
    return RunCommandReply(command_id=cmd.command_id, outcome=outcome, status=status, message=message)


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


def load_tasks(conn: Connection, name: str, split: str, version: int | None,
               limit: int | None) -> list[tuple[str, dict, str]]:
    """(task_id, data, data_source) of the run's pinned dataset version (None: the latest) in row order; raises
    ValueError when it is missing. Versions are immutable, so a rebuilt plan reads the rows the run started with."""
    found = conn.execute(_dataset_version(name, split, version)).scalar()
    if found is None:
        which = f" version {version}" if version is not None else ""
        raise ValueError(f"dataset {name!r} split {split!r}{which} is not registered; register it "
                         "(POST /v1/datasets) or fix `dataset` / `dataset_split` / `dataset_version` in the run config")
    rows = conn.execute(select(DatasetRow.task_id, DatasetRow.data, DatasetRow.data_source)
                        .where(DatasetRow.dataset_id == found).order_by(DatasetRow.idx).limit(limit)).all()
    ids = [r[0] for r in rows]
    if len(set(ids)) != len(ids):
        raise ValueError(f"dataset {name!r} split {split!r} has duplicate task ids; give each row a unique "
                         "'task_id' or 'id' field")
    return [tuple(r) for r in rows]


def _dataset_version(name: str, split: str, version: int | None):
    """The id of a dataset's version (None: the latest), as a query."""
    query = select(Dataset.id).where(Dataset.name == name, Dataset.split == split)
    if version is not None:
        query = query.where(Dataset.version == version)
    return query.order_by(Dataset.version.desc()).limit(1)


def ledger_rows(conn: Connection, run_id: str) -> list[LedgerRow]:
    t = RolloutTaskRow
    return [LedgerRow(*r) for r in conn.execute(
        select(t.task_id, t.sample_idx, t.attempt, t.status, t.batch_idx, t.epoch, t.greedy)
        .where(t.run_id == run_id).order_by(t.attempt)).all()]


def ended_among(conn: Connection, run_id: str, keys: list[tuple[str, int, int]]
                ) -> list[tuple[str, int, int, str, str | None]]:
    """Which of these (task, sample, attempt) rows are no longer 'dispatched', their status and error."""
    if not keys:
        return []
    tasks, samples, attempts = (list(c) for c in zip(*keys, strict=True))
    return [tuple(r) for r in conn.execute(text(  # hand-tuned: the plan matters here, and Core would hide it
        # LATERAL: one primary-key probe per key. A plain join let the planner hash every ended row of the run,
        # a cost that grew with the run on every pass.
        """SELECT t.task_id, t.sample_idx, t.attempt, t.status, t.error
           FROM unnest(CAST(:t AS text[]), CAST(:s AS int[]), CAST(:a AS int[])) AS k(task_id, sample_idx, attempt)
           JOIN LATERAL (SELECT * FROM rollout_tasks r WHERE r.run_id = :r AND r.task_id = k.task_id
                         AND r.sample_idx = k.sample_idx AND r.attempt = k.attempt) t ON true
           WHERE t.status <> 'dispatched'"""
    ), {"r": run_id, "t": tasks, "s": samples, "a": attempts}).all()]


def insert_dispatched(conn: Connection, run_id: str, items: list[tuple[Slot, int]], version: int,
                      lease_s: float) -> set[tuple[str, int, int]]:
    """Ledger rows first (before XADD). Returns the keys actually inserted: a key another controller already
    inserted is not ours to publish."""
    if not items:
        return set()
    cols = list(zip(*[(s.task_id, s.sample_idx, a, s.batch_idx, s.epoch, s.greedy) for s, a in items], strict=True))
    rows = conn.execute(text(  # hand-tuned: one array per column (unnest) instead of a bind parameter per value
        """INSERT INTO rollout_tasks (run_id, task_id, sample_idx, attempt, status, batch_idx, epoch, greedy,
                                      dispatch_version, lease_expires_at)
           SELECT :r, t, s, a, 'dispatched', b, e, g, :v, now() + make_interval(secs => :lease)
           FROM unnest(CAST(:t AS text[]), CAST(:s AS int[]), CAST(:a AS int[]), CAST(:b AS int[]),
                       CAST(:e AS int[]), CAST(:g AS bool[])) AS x(t, s, a, b, e, g)
           ON CONFLICT DO NOTHING RETURNING task_id, sample_idx, attempt"""
    ), {"r": run_id, "v": version, "lease": lease_s, "t": list(cols[0]), "s": list(cols[1]), "a": list(cols[2]),
        "b": list(cols[3]), "e": list(cols[4]), "g": list(cols[5])}).all()
    return {tuple(r) for r in rows}


def mark_published(conn: Connection, run_id: str, keys: list[tuple[str, int, int]]) -> None:
    """These (task, sample, attempt) rows' tasks are on `rollout.tasks` (their XADD returned)."""
    if not keys:
        return
    tasks, samples, attempts = (list(c) for c in zip(*keys, strict=True))
    conn.execute(text(  # hand-tuned: one array per key column (unnest)
        """UPDATE rollout_tasks t SET published_at = now()
           FROM unnest(CAST(:t AS text[]), CAST(:s AS int[]), CAST(:a AS int[])) AS k(task_id, sample_idx, attempt)
           WHERE t.run_id = :r AND (t.task_id, t.sample_idx, t.attempt) = (k.task_id, k.sample_idx, k.attempt)"""
    ), {"r": run_id, "t": tasks, "s": samples, "a": attempts})


def take_unpublished(conn: Connection, run_id: str, lease_s: float) -> list[tuple[str, int, int, int]]:
    """Dispatched rows whose task was never known to be published (a controller died between the ledger commit
    and the XADD), their lease renewed for `lease_s` from now: (task, sample, attempt, dispatch_version)."""
    t = RolloutTaskRow
    return [tuple(r) for r in conn.execute(
        update(t).where(t.run_id == run_id, t.status == "dispatched", t.published_at.is_(None))
        .values(lease_expires_at=func.now() + timedelta(seconds=lease_s))
        .returning(t.task_id, t.sample_idx, t.attempt, t.dispatch_version)).all()]


def dropped_groups(conn: Connection, run_id: str, final_failed: list[tuple[str, int]]) -> int:
    """Groups of a train run consumed without a step: those the trainer reported dropped (`consumed_groups`,
    from `trainer.progress`) and those with a finally failed slot (never complete, perhaps never seen by the
    trainer). `final_failed`: (task_id, batch_idx) of the finally failed slots. A group is (task, batch)."""
    tasks, batches = [k[0] for k in final_failed], [k[1] for k in final_failed]
    return conn.execute(text(  # kept as SQL: a UNION with an unnest of arrays reads plainer than its Core form
        """SELECT count(*) FROM (
               SELECT task_id, batch_idx FROM consumed_groups WHERE run_id = :r AND status <> 'used'
               UNION
               SELECT t, b FROM unnest(CAST(:t AS text[]), CAST(:b AS int[])) AS f(t, b)) AS g"""
    ), {"r": run_id, "t": tasks, "b": batches}).scalar_one()


def record_progress(db: Engine, msgs: list[TrainerProgress]) -> None:
    """Apply `trainer.progress`: the run's policy version (never backwards), the groups it consumed (the
    first report of a group wins), and a trainer's error as one `trainer_error` event per distinct error.
    Idempotent: the trainer re-sends freely. Runs that no longer exist are skipped."""
    with db.begin() as conn:
        for m in msgs:
            if m.error is not None:
                conn.execute(text(
                    """INSERT INTO run_events (run_id, kind, message, data)
                       SELECT CAST(:r AS uuid), 'trainer_error', :m, '{}'
                       WHERE EXISTS (SELECT 1 FROM runs WHERE id = CAST(:r AS uuid))
                         AND NOT EXISTS (SELECT 1 FROM run_events WHERE run_id = CAST(:r AS uuid)
                                         AND kind = 'trainer_error' AND message = :m)"""
                ), {"r": m.run_id, "m": m.error})
            conn.execute(update(Run).where(Run.id == m.run_id)
                         .values(policy_version=func.greatest(Run.policy_version, m.version)))
            if m.groups:
                conn.execute(text(  # hand-tuned: one array per column (unnest), skipped whole when the run is gone
                    """INSERT INTO consumed_groups (run_id, task_id, batch_idx, status, version)
                       SELECT CAST(:r AS uuid), t, b, s, :v FROM unnest(CAST(:t AS text[]), CAST(:b AS int[]),
                                                                      CAST(:s AS text[])) AS g(t, b, s)
                       WHERE EXISTS (SELECT 1 FROM runs WHERE id = CAST(:r AS uuid))
                       ON CONFLICT DO NOTHING"""
                ), {"r": m.run_id, "v": m.version, "t": [g.task_id for g in m.groups],
                    "b": [g.batch_idx for g in m.groups], "s": [g.status for g in m.groups]})


def unconsumed_groups(conn: Connection, run_id: str) -> set[tuple[str, int]]:
    """(task_id, batch_idx) of the groups with stored completed results that the trainer has not reported
    consuming."""
    e, g = EpisodeRow, ConsumedGroupRow
    consumed = exists().where(g.run_id == e.run_id, g.task_id == e.task_id, g.batch_idx == e.batch_idx)
    query = select(e.task_id, e.batch_idx).distinct().where(e.run_id == run_id, e.status == "completed", ~consumed)
    return {tuple(r) for r in conn.execute(query).all()}


def final_failures(conn: Connection, run_id: str) -> list[tuple[str, int, int, int, bool]]:
    """(task_id, sample_idx, attempt, batch_idx, greedy) of every slot recorded out of attempts or errored (the
    user's code failed): slots whose groups can never complete."""
    t, e = RolloutTaskRow, RunEvent
    slot = and_(t.run_id == e.run_id, t.task_id == e.data["task_id"].astext,
                t.sample_idx == cast(e.data["sample_idx"].astext, Integer),
                t.attempt == cast(e.data["attempt"].astext, Integer))
    recorded = select(t.task_id, t.sample_idx, t.attempt, t.batch_idx, t.greedy).select_from(e).join(t, slot) \
        .where(e.run_id == run_id, e.kind == "final_failure")
    errored = select(t.task_id, t.sample_idx, t.attempt, t.batch_idx, t.greedy) \
        .where(t.run_id == run_id, t.status == "error")
    return [tuple(r) for r in conn.execute(recorded.union_all(errored)).all()]


def top_reasons(conn: Connection, run_id: str, limit: int = 5) -> list[dict[str, Any]]:
    """Why units that never scored ended so, most common first: [{"reason", "status" (error | failed | lost),
    "count" (attempts)}]. A user-code error's reason is its ledger row's error ("<where>: <exception>"); an infrastructure
    failure's is its traceback's last line, numbers and addresses folded together."""
    from services.controller.run_driver import outcome_reason

    t, c = RolloutTaskRow, aliased(RolloutTaskRow)
    scored = exists().where(c.run_id == t.run_id, c.task_id == t.task_id, c.sample_idx == t.sample_idx,
                            c.status == "completed")  # a unit re-run and then scored did not end unscored
    rows = conn.execute(select(t.status, t.error, func.count()).where(
        t.run_id == run_id, t.status.in_(("error", "failed", "lost")), ~scored).group_by(t.status, t.error)
        .order_by(func.count().desc()).limit(500)).all()
    counts: dict[tuple[str, str], int] = {}
    for status, error, n in rows:
        key = (status, outcome_reason(status, error))
        counts[key] = counts.get(key, 0) + n
    top = sorted(counts.items(), key=lambda kv: -kv[1])[:limit]
    return [{"reason": reason, "status": status, "count": n} for (status, reason), n in top]


def active_train_runs(db: Engine) -> list[str]:
    with db.connect() as conn:
        return list(conn.execute(select(cast(Run.id, Text))
                                 .where(Run.kind == "train", Run.status.in_(ACTIVE_STATUSES))).scalars())


def expire_leases(conn: Connection, run_id: str, held: list[tuple[str, int, int]] = (), renew_s: float = 0.0
                  ) -> list[tuple[str, int, int]]:
    """Mark dispatched rows past their lease as lost (their result never arrived, or Redis lost it), except
    those `held` (a live rollout worker runs them, or they wait in the stream re-stamped): their lease is
    renewed for `renew_s` once less than half of it is left."""
    t = RolloutTaskRow
    if held:
        tasks, samples, attempts = (list(c) for c in zip(*held, strict=True))
        conn.execute(text(  # hand-tuned: one array per key column (unnest)
            """UPDATE rollout_tasks t SET lease_expires_at = now() + make_interval(secs => :s)
               FROM unnest(CAST(:t AS text[]), CAST(:sa AS int[]), CAST(:a AS int[])) AS k(task_id, sample_idx, attempt)
               WHERE t.run_id = :r AND (t.task_id, t.sample_idx, t.attempt) = (k.task_id, k.sample_idx, k.attempt)
                 AND t.status = 'dispatched' AND t.lease_expires_at < now() + make_interval(secs => :s / 2)"""
        ), {"r": run_id, "t": tasks, "sa": samples, "a": attempts, "s": renew_s})
    return [tuple(r) for r in conn.execute(
        update(t).where(t.run_id == run_id, t.status == "dispatched", t.lease_expires_at < func.now())
        .values(status="lost", finished_at=func.now(), error="no result before the task lease expired")
        .returning(t.task_id, t.sample_idx, t.attempt)).all()]


def fail_dispatched(conn: Connection, run_id: str, key: tuple[str, int, int], error: str) -> bool:
    """A dead-lettered rollout task: its attempt has failed (retried as attempt+1 if attempts remain)."""
    t = RolloutTaskRow
    return conn.execute(
        update(t).where(t.run_id == run_id, t.task_id == key[0], t.sample_idx == key[1], t.attempt == key[2],
                        t.status == "dispatched")
        .values(status="failed", finished_at=func.now(), error=error)).rowcount == 1


def cancel_dispatched(conn: Connection, run_id: str, keys: list[tuple[str, int, int]], error: str
                      ) -> list[tuple[str, int, int]]:
    """Cancel these (task, sample, attempt) rows if still dispatched; returns those cancelled."""
    if not keys:
        return []
    tasks, samples, attempts = (list(c) for c in zip(*keys, strict=True))
    return [tuple(r) for r in conn.execute(text(  # hand-tuned: one array per key column (unnest)
        """UPDATE rollout_tasks t SET status = 'cancelled', finished_at = now(), error = :err
           FROM unnest(CAST(:t AS text[]), CAST(:s AS int[]), CAST(:a AS int[])) AS k(task_id, sample_idx, attempt)
           WHERE t.run_id = :r AND (t.task_id, t.sample_idx, t.attempt) = (k.task_id, k.sample_idx, k.attempt)
             AND t.status = 'dispatched'
           RETURNING t.task_id, t.sample_idx, t.attempt"""
    ), {"r": run_id, "t": tasks, "s": samples, "a": attempts, "err": error}).all()]


def cancel_in_flight(conn: Connection, run_id: str) -> int:
    t = RolloutTaskRow
    return conn.execute(update(t).where(t.run_id == run_id, t.status == "dispatched")
                        .values(status="cancelled", finished_at=func.now(), error="run stopped")).rowcount


def eval_samples(conn: Connection, run_id: str, name: str, split: str,
                 version: int | None) -> list[tuple[str, str, bool]]:
    """(task_id, data_source, is_correct) of every stored completed sample of an eval run (data_source from the
    run's dataset version; None: the latest)."""
    rows = select(DatasetRow.task_id, DatasetRow.data_source) \
        .where(DatasetRow.dataset_id == _dataset_version(name, split, version).scalar_subquery()).subquery()
    e = EpisodeRow
    return [tuple(r) for r in conn.execute(
        select(e.task_id, func.coalesce(rows.c.data_source, ""), e.is_correct)
        .outerjoin(rows, rows.c.task_id == e.task_id).where(e.run_id == run_id, e.status == "completed")).all()]


def write_summary(conn: Connection, run_id: str, summary: dict) -> None:
    conn.execute(update(Run).where(Run.id == run_id)
                 .values(summary=Run.summary.op("||")(literal(summary, JSONB))))


def requeued_units(conn: Connection, run_id: str) -> int:
    """Units that scored after a lost or failed attempt was re-run."""
    t, c = RolloutTaskRow, aliased(RolloutTaskRow)
    return conn.execute(select(func.count(func.distinct(func.row(t.task_id, t.sample_idx)))).where(
        t.run_id == run_id, t.status.in_(("failed", "lost")),
        exists().where(c.run_id == t.run_id, c.task_id == t.task_id, c.sample_idx == t.sample_idx,
                       c.status == "completed"))).scalar_one()


def ledger_summary(conn: Connection, run_id: str) -> dict[str, int]:
    """{dispatched (attempts put on the stream), completed, error, failed, lost, cancelled, in_flight,
    finished}."""
    t = RolloutTaskRow
    counts = dict.fromkeys(LEDGER_ROW_STATUSES, 0)
    for status, n in conn.execute(select(t.status, func.count()).where(t.run_id == run_id).group_by(t.status)):
        counts[status] = counts.get(status, 0) + n
    in_flight = counts.pop("dispatched")
    total = in_flight + sum(counts.values())
    return {"dispatched": total, "in_flight": in_flight, **counts, "finished": total - in_flight}
