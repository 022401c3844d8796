"""TrajectoryStore: writes EpisodeResults (stream `trajectories`, group "store") into Postgres; the one place
that decides whether a result is accepted.
    store = TrajectoryStore(make_engine(url))
    outcome = store.write(results)   # one transaction; ack the stream entries after it returns

Guarantees: one transaction per batch (episodes, trajectories, steps, token arrays AND the ledger rows);
idempotent (natural-key ids, ON CONFLICT DO NOTHING); a result is applied only if its ledger row is live
(status "dispatched"), else recorded once as a `late_result` run event and not stored as a trajectory; a
Tinker run's samples (never dispatched, never trained on) are stored with no ledger row.
More: docs/architecture.md#the-trajectory-store
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, Literal

import numpy as np
from psycopg.adapt import Dumper
from psycopg.pq import Format
from psycopg.types.json import Jsonb
from sqlalchemy import Column, Engine, Table, and_, select
from sqlalchemy.dialects import postgresql

from shared.contracts.db.models import EpisodeRow, StepRecordRow, TokenStreamRow, TrajectoryRow
from shared.contracts.messages.trajectory import EpisodeResult, TrajectoryRecord

_ID_NAMESPACE = uuid.UUID("5b0c4cf0-6f5e-4c1d-9a56-6a1f0f8f4f10")
_MAX_PARAMS = 60_000  # Postgres caps bind parameters per statement at 65535


def _copy_spec(table: Table) -> list[tuple[str, str]]:
    """(column, Postgres type) of the columns the store writes, in the models' order (the row tuples' order):
    all but those the database fills itself (created_at). Types as psycopg's COPY names them: "FLOAT" is
    Postgres's float8, and lengths such as varchar(200) are the column's business, not the wire's."""
    def pg_type(column: Column) -> str:
        name = re.sub(r"\(\d+\)", "", column.type.compile(dialect=postgresql.dialect()).lower())
        return {"float": "float8"}.get(name, name)

    return [(c.name, pg_type(c)) for c in table.columns if c.server_default is None]


# The four tables a result writes, derived from shared/contracts/db/models.py (the one copy of the schema).
TABLES: dict[str, list[tuple[str, str]]] = {
    model.__tablename__: _copy_spec(model.__table__) for model in (EpisodeRow, TrajectoryRow, StepRecordRow, TokenStreamRow)
}

Key = tuple[str, str, int, int]  # (run_id, task_id, sample_idx, attempt)


@dataclass
class StoreOutcome:
    """What one `write` did. `late` holds the keys recorded as late_result events."""

    stored: int = 0  # completed results stored with their trajectories
    failed: int = 0  # failed results recorded (ledger row failed)
    errored: int = 0  # results whose user code failed (ledger row error)
    duplicates: int = 0  # re-deliveries of results already applied
    late: list[Key] = field(default_factory=list)
    rows: int = 0  # rows inserted across the four trajectory tables
    ended: list[tuple[Key, str]] = field(default_factory=list)  # ledger rows this write ended, new status
    to_train: list[EpisodeResult] = field(default_factory=list)  # for `results.accepted` (module docstring)


def episode_id(key: Key) -> uuid.UUID:
    return uuid.uuid5(_ID_NAMESPACE, "/".join(map(str, key)))


def trajectory_id(ep_id: uuid.UUID, traj_idx: int) -> uuid.UUID:
    return uuid.uuid5(ep_id, str(traj_idx))


class TrajectoryStore:
    def __init__(self, engine: Engine, method: Literal["copy", "values"] = "copy"):
        if method not in ("copy", "values"):
            raise ValueError(f"TrajectoryStore method must be 'copy' or 'values', got {method!r}")
        self.engine = engine
        self.method = method

    def write(self, results: Sequence[EpisodeResult]) -> StoreOutcome:
        """Apply a batch in one transaction (see the module docstring). Safe to call again with the same batch."""
        outcome = StoreOutcome()
        if not results:
            return outcome
        with self.engine.begin() as conn:
            cur = conn.connection.driver_connection.cursor()
            ledger, train_runs = _lock_ledger(cur, [r.key for r in results])
            accepted, late = _classify(results, ledger, outcome, _tinker_runs(cur, {r.run_id for r in results}))
            rows = build_rows(accepted)
            outcome.rows = sum(len(v) for v in rows.values())
            insert = _copy_insert if self.method == "copy" else _values_insert
            for table, table_rows in rows.items():
                insert(cur, table, table_rows)
            _finish_ledger(cur, accepted)
            _record_late(cur, late)
        outcome.ended = [(r.key, r.status) for r in accepted]
        stored = {r.key for r in accepted} | {k for k, status in ledger.items() if status == "completed"}
        once: dict[Key, EpisodeResult] = {}
        for r in results:  # the first of a key is the one stored
            if r.status == "completed" and r.key in stored and r.run_id in train_runs:
                once.setdefault(r.key, r)
        outcome.to_train = list(once.values())
        return outcome


# -- acceptance -------------------------------------------------------------------------------------------------
# The write path runs on the driver's cursor: binary COPY and one array per column keep ingest fast
# (bench/rollout.py), and the ledger lock (FOR UPDATE in key order) is spelled out where it is taken.
def _lock_ledger(cur, keys: list[Key]) -> tuple[dict[Key, str], set[str]]:
    """Ledger status of each key (locked until commit), and which of their runs are training runs."""
    cur.execute(
        """SELECT t.run_id::text, t.task_id, t.sample_idx, t.attempt, t.status FROM rollout_tasks t
           JOIN unnest(%s::uuid[], %s::text[], %s::int[], %s::int[]) AS k(run_id, task_id, sample_idx, attempt)
             USING (run_id, task_id, sample_idx, attempt)
           ORDER BY 1, 2, 3, 4 FOR UPDATE OF t""",
        [list(col) for col in zip(*sorted(set(keys)), strict=True)],
    )
    ledger = {(r[0], r[1], r[2], r[3]): r[4] for r in cur.fetchall()}
    # The run kinds apart: joining `runs` into the query above made the planner hash-join a sequential scan of
    # the whole ledger (Postgres CPU per stored trajectory grew with the run, 4 ms at 24k tasks).
    cur.execute("SELECT id::text FROM runs WHERE id = ANY(%s::uuid[]) AND kind = 'train'",
                [sorted({k[0] for k in ledger})])
    return ledger, {r[0] for r in cur.fetchall()}


def _tinker_runs(cur, run_ids: set[str]) -> set[str]:
    cur.execute("SELECT id::text FROM runs WHERE id = ANY(%s::uuid[]) AND kind = 'tinker'", [sorted(run_ids)])
    return {r[0] for r in cur.fetchall()}


def _classify(
    results: Sequence[EpisodeResult], ledger: dict[Key, str], outcome: StoreOutcome, tinker_runs: set[str] = frozenset()
) -> tuple[list[EpisodeResult], list[tuple[EpisodeResult, str | None]]]:
    accepted, late, seen = [], [], set()
    for r in results:
        status = ledger.get(r.key)
        if r.key in seen or status == r.status:  # same message again (in this batch or already applied)
            outcome.duplicates += 1
        elif status == "dispatched" or (status is None and r.run_id in tinker_runs):
            accepted.append(r)
            outcome.stored += r.status == "completed"
            outcome.failed += r.status == "failed"
            outcome.errored += r.status == "error"
        else:  # lost, cancelled, ended otherwise, or never dispatched by a controller
            late.append((r, status))
            outcome.late.append(r.key)
        seen.add(r.key)
    return accepted, late


def _finish_ledger(cur, accepted: list[EpisodeResult]) -> None:
    if not accepted:
        return
    cols = list(zip(*[(*r.key, r.status, r.worker_id, _text(ledger_error(r))) for r in accepted], strict=True))
    cur.execute(
        """UPDATE rollout_tasks t SET status = v.status, worker_id = v.worker_id, error = v.error,
               finished_at = now()
           FROM unnest(%s::uuid[], %s::text[], %s::int[], %s::int[], %s::text[], %s::text[], %s::text[])
             AS v(run_id, task_id, sample_idx, attempt, status, worker_id, error)
           WHERE (t.run_id, t.task_id, t.sample_idx, t.attempt) = (v.run_id, v.task_id, v.sample_idx, v.attempt)""",
        [list(c) for c in cols],
    )


def ledger_error(r: EpisodeResult) -> str | None:
    """The ledger keeps an error's first line for a user-code error (its reason, summed up per run), the whole
    error for an infrastructure failure (its reason is the traceback's last line)."""
    if r.status == "error" and r.error:
        return r.error.split("\n", 1)[0]
    return r.error


def _record_late(cur, late: list[tuple[EpisodeResult, str | None]]) -> None:
    """One late_result event per (attempt, result status): a re-delivered late result adds nothing."""
    for r, ledger_status in late:
        data = {"task_id": r.task_id, "sample_idx": r.sample_idx, "attempt": r.attempt, "result_status": r.status}
        cur.execute(
            """INSERT INTO run_events (run_id, kind, message, data)
               SELECT %(run)s, 'late_result', %(msg)s, %(data)s
               WHERE EXISTS (SELECT 1 FROM runs WHERE id = %(run)s)
                 AND NOT EXISTS (SELECT 1 FROM run_events WHERE run_id = %(run)s AND kind = 'late_result'
                                 AND data @> %(data)s)""",
            {
                "run": uuid.UUID(r.run_id), "data": Jsonb({**data}), "msg":
                f"result of {r.task_id}/{r.sample_idx} attempt {r.attempt} arrived after the ledger row was "
                f"{ledger_status or 'never dispatched'}; not stored",
            },
        )


# -- reading back -----------------------------------------------------------------------------------------------
def load_results(conn, run_id: str, groups: set[tuple[str, int]] | None = None) -> list[EpisodeResult]:
    """The stored completed results of a run (those of `groups`, (task_id, batch_idx), when given), rebuilt from
    their rows with what training needs: each trajectory's assembled tokens, rewards and reasons. For replaying
    `results.accepted` when Redis lost it (the steps' texts are not reloaded)."""
    e, t, a = EpisodeRow, TrajectoryRow, TokenStreamRow
    rows = conn.execute(
        select(e.task_id, e.sample_idx, e.attempt, e.termination_reason, e.is_correct, e.reward, e.batch_idx,
               e.greedy, e.worker_id, t.uid, t.name, t.reward.label("t_reward"),
               t.termination_reason.label("t_reason"), t.mismatch, a.prompt_ids, a.response_ids, a.logprobs,
               a.loss_mask, a.versions)
        .outerjoin(t, t.episode_id == e.id).outerjoin(a, and_(a.trajectory_id == t.id, a.step_idx == -1))
        .where(e.run_id == uuid.UUID(run_id), e.status == "completed")
        .order_by(e.task_id, e.sample_idx, e.attempt, t.traj_idx)).all()
    out: dict[tuple, EpisodeResult] = {}
    for r in rows:
        if groups is not None and (r.task_id, r.batch_idx) not in groups:
            continue
        key = (r.task_id, r.sample_idx, r.attempt)
        if key not in out:
            out[key] = EpisodeResult(
                run_id=run_id, task_id=r.task_id, sample_idx=r.sample_idx, attempt=r.attempt, status="completed",
                termination_reason=r.termination_reason, is_correct=r.is_correct, reward=r.reward,
                batch_idx=r.batch_idx, greedy=r.greedy, worker_id=r.worker_id)
        if r.uid is not None:
            out[key].trajectories.append(TrajectoryRecord(
                uid=r.uid, name=r.name, reward=r.t_reward, termination_reason=r.t_reason, mismatch=r.mismatch,
                prompt_ids=r.prompt_ids or [], response_ids=r.response_ids or [], logprobs=r.logprobs or [],
                loss_mask=r.loss_mask or [], versions=r.versions or []))
    return list(out.values())


# -- rows -------------------------------------------------------------------------------------------------------
def build_rows(results: Sequence[EpisodeResult]) -> dict[str, list[tuple]]:
    """Row tuples per table, in TABLES column order. Failed results get an episode row only. Linear in a
    trajectory's length: the assembled token stream is stored once and a step's arrays only where they are not
    a slice of it; a step's chat as the messages it added to the step before's (the views `steps` and
    `token_arrays` rebuild whole steps)."""
    rows: dict[str, list[tuple]] = {t: [] for t in TABLES}
    for r in results:
        ep_id = episode_id(r.key)
        rows["episodes"].append(_episode_row(ep_id, r))
        if r.status == "failed":
            continue
        for traj_idx, traj in enumerate(r.trajectories):
            tid = trajectory_id(ep_id, traj_idx)
            rows["trajectories"].append(_trajectory_row(tid, ep_id, r, traj_idx, traj))
            stream = traj.prompt_ids + traj.response_ids
            # a sequence of a trajectory cut at its agent's context rewrites numbers its steps by their turn
            # in the whole trajectory, so per-turn SQL reads the same cut or not
            first = traj.info.get("first_turn", 0) if isinstance(traj.info.get("first_turn"), int) else 0
            for k, (s, (chat_from, added)) in enumerate(zip(traj.steps, traj.chat_deltas(), strict=True)):
                cut = traj.stream_slice(s, stream)
                rows["step_records"].append((
                    tid, first + k, _json(added), _json(s.observation), _text(s.thought),
                    _json(s.action), _text(s.model_response), s.reward, s.done, s.mc_return, _json(s.info),
                    s.weight_version, *s.lengths, s.gen_ms, s.env_ms, first + chat_from, cut is not None,
                ))
                if cut is None:
                    rows["token_streams"].append((tid, first + k, s.prompt_ids, s.response_ids, s.logprobs, None, None))
            rows["token_streams"].append(
                (tid, -1, traj.prompt_ids, traj.response_ids, traj.logprobs, traj.loss_mask, traj.versions)
            )
    return rows


def _episode_row(ep_id: uuid.UUID, r: EpisodeResult) -> tuple:
    vmin, vmax = r.policy_versions
    return (
        ep_id, uuid.UUID(r.run_id), r.task_id, r.sample_idx, r.attempt, r.status, r.termination_reason.value,
        r.is_correct, r.reward, r.greedy, r.batch_idx, vmin, vmax, _json(r.task), _json(r.metrics),
        _json(r.info), _text(r.error), r.worker_id, _ts(r.started_at), _ts(r.finished_at),
    )


def _trajectory_row(tid: uuid.UUID, ep_id: uuid.UUID, r: EpisodeResult, idx: int, t: TrajectoryRecord) -> tuple:
    vmin, vmax = t.policy_versions
    prompt_tokens = len(t.prompt_ids) or sum(len(s.prompt_ids) for s in t.steps[:1])
    response_tokens = sum(t.loss_mask) if t.loss_mask else sum(s.lengths[1] for s in t.steps)
    return (
        tid, ep_id, uuid.UUID(r.run_id), r.task_id, r.sample_idx, r.attempt, idx, t.uid[:64], t.name[:100],
        t.reward, t.termination_reason.value, len(t.steps), prompt_tokens, response_tokens, vmin, vmax,
        t.mismatch, _json(t.info),
    )


def _dumps(obj: Any) -> str:
    # Postgres text and jsonb reject NUL characters, which a random-init model can produce.
    return json.dumps(obj, default=str).replace("\\u0000", "")


def _json(obj: Any) -> Jsonb | None:
    return None if obj is None else Jsonb(obj, dumps=_dumps)


def _text(s: str | None) -> str | None:
    return None if s is None else s.replace("\x00", "")


def _ts(t: float) -> datetime | None:
    return datetime.fromtimestamp(t, UTC) if t else None


# -- insert methods ---------------------------------------------------------------------------------------------
def _copy_insert(cur, table: str, rows: list[tuple]) -> None:
    """Binary COPY into a session temp table, then INSERT ... SELECT ... ON CONFLICT DO NOTHING."""
    if not rows:
        return
    cols = ", ".join(c for c, _ in TABLES[table])
    tmp = f"_store_{table}"
    # ON COMMIT DELETE ROWS empties it at commit without the new file a per-batch TRUNCATE would create.
    cur.execute(f"CREATE TEMP TABLE IF NOT EXISTS {tmp} ON COMMIT DELETE ROWS AS SELECT {cols} FROM {table} WITH NO DATA")
    copy_rows(cur, tmp, TABLES[table], rows)
    cur.execute(f"INSERT INTO {table} ({cols}) SELECT {cols} FROM {tmp} ON CONFLICT DO NOTHING")


def copy_rows(cur, table: str, spec: list[tuple[str, str]], rows: list[tuple]) -> None:
    """Binary COPY of row tuples; token arrays packed with numpy (psycopg's list dumper is pure Python and
    was half of the store's time in a profile)."""
    for dumper in _ARRAY_DUMPERS:
        cur.adapters.register_dumper(None, dumper)  # by oid only: affects this cursor's COPY of array columns
    with cur.copy(f"COPY {table} ({', '.join(c for c, _ in spec)}) FROM STDIN (FORMAT BINARY)") as copy:
        copy.set_types([t for _, t in spec])
        for row in rows:
            copy.write_row(row)


def _array_dumper(array_oid: int, elem_oid: int, code: str, size: int) -> type[Dumper]:
    """Postgres binary array: ndim, has-null flag, element oid, (length, lower bound), then (size, value)*."""
    item = np.dtype([("size", ">i4"), ("value", code)])
    empty = np.array([0, 0, elem_oid], dtype=">i4").tobytes()

    class PackedArrayDumper(Dumper):
        format = Format.BINARY
        oid = array_oid

        def dump(self, obj) -> bytes:
            if len(obj) == 0:
                return empty
            items = np.empty(len(obj), dtype=item)
            items["size"], items["value"] = size, obj
            return np.array([1, 0, elem_oid, len(obj), 1], dtype=">i4").tobytes() + items.tobytes()

    return PackedArrayDumper


_ARRAY_DUMPERS = [_array_dumper(1007, 23, ">i4", 4), _array_dumper(1021, 700, ">f4", 4), _array_dumper(1005, 21, ">i2", 2)]


def _values_insert(cur, table: str, rows: list[tuple]) -> None:
    """Multi-row INSERT ... VALUES (...), (...) ON CONFLICT DO NOTHING, chunked under the parameter cap."""
    if not rows:
        return
    spec = TABLES[table]
    cols = ", ".join(c for c, _ in spec)
    one = "(" + ", ".join(f"%s::{t}" for _, t in spec) + ")"
    per = max(1, _MAX_PARAMS // len(spec))
    for i in range(0, len(rows), per):
        chunk = rows[i:i + per]
        sql = f"INSERT INTO {table} ({cols}) VALUES " + ", ".join([one] * len(chunk)) + " ON CONFLICT DO NOTHING"
        cur.execute(sql, [v for row in chunk for v in row])
