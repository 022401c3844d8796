"""TrajectoryStore over a real migrated Postgres: idempotency, batches, the acceptance rule, the ledger."""

from __future__ import annotations

import uuid

import pytest
from sqlalchemy import insert, select, text, update

from services.controller.run_summary import ledger_summary
from services.controller.store import TrajectoryStore
from shared.contracts.db.models import RolloutTaskRow, Run, RunEvent
from shared.contracts.messages import EpisodeResult, TrajectoryRecord, TrajectoryStep, decode, encode
from shared.platform.db.session import make_engine
from shared.sdk.types import TerminationReason
from tests.support.multi_turn import multi_turn


@pytest.fixture(scope="module")
def engine(database_url):
    eng = make_engine(database_url)
    yield eng
    eng.dispose()


def new_run(engine, kind: str = "eval") -> str:
    run_id = uuid.uuid4()
    with engine.begin() as c:
        c.execute(insert(Run).values(id=run_id, name="t", kind=kind, status="running", config={}))
    return str(run_id)


def dispatch(engine, run_id: str, keys: list[tuple[str, int, int]]) -> None:
    rows = [dict(run_id=uuid.UUID(run_id), task_id=t, sample_idx=s, attempt=a, status="dispatched", batch_idx=0,
                 epoch=0, greedy=False, dispatch_version=0) for t, s, a in keys]
    with engine.begin() as c:
        c.execute(insert(RolloutTaskRow), rows)


def result(run_id: str, task_id: str, sample_idx: int = 0, attempt: int = 0, *, status="completed",
           steps: int = 2) -> EpisodeResult:
    step_records = [
        TrajectoryStep(prompt_ids=[1, 2, 3], response_ids=[4, 5], logprobs=[-0.5, -0.25], observation={"q": "1+1"},
                   action="\\boxed{2}", model_response="ok\x00", reward=1.0, done=i == steps - 1, weight_version=3)
        for i in range(steps)
    ]
    traj = TrajectoryRecord(uid=uuid.uuid4().hex, reward=1.0, termination_reason="env_done", steps=step_records,
                            prompt_ids=[1, 2, 3], response_ids=[4, 5, 9, 4, 5], loss_mask=[1, 1, 0, 1, 1],
                            logprobs=[-0.5, -0.25, 0.0, -0.5, -0.25], versions=[3, 3, -1, 3, 3])
    msg = EpisodeResult(run_id=run_id, task_id=task_id, sample_idx=sample_idx, attempt=attempt, status=status,
                        termination_reason="env_done" if status == "completed" else "infra_error", is_correct=True,
                        reward=1.0, task={"question": "1+1"}, trajectories=[traj] if status == "completed" else [],
                        error=None if status == "completed" else "env session lost", worker_id="w1")
    return decode(encode(msg))  # exactly what a consumer gets off the wire


def counts(engine, run_id: str) -> dict[str, int]:
    q = {
        "episodes": "SELECT count(*) FROM episodes WHERE run_id = :r",
        "trajectories": "SELECT count(*) FROM trajectories WHERE run_id = :r",
        "steps": "SELECT count(*) FROM steps s JOIN trajectories t ON t.id = s.trajectory_id WHERE t.run_id = :r",
        "token_arrays": "SELECT count(*) FROM token_arrays a JOIN trajectories t ON t.id = a.trajectory_id "
                        "WHERE t.run_id = :r",
        "late": "SELECT count(*) FROM run_events WHERE run_id = :r AND kind = 'late_result'",
    }
    with engine.connect() as c:
        return {k: c.execute(text(v), {"r": run_id}).scalar_one() for k, v in q.items()}


@pytest.mark.parametrize("method", ["copy", "values"])
def test_redelivery_stores_one_set_of_rows(engine, method):
    store = TrajectoryStore(engine, method=method)
    run = new_run(engine)
    dispatch(engine, run, [("t0", 0, 0)])
    msg = result(run, "t0")
    first = store.write([msg])
    assert (first.stored, first.rows) == (1, 1 + 1 + 2 + 1)  # both steps' arrays are slices of the stream
    again = store.write([msg, msg])  # re-delivered twice, even within one batch
    assert again.stored == 0 and again.duplicates == 2 and again.rows == 0
    assert counts(engine, run) == {"episodes": 1, "trajectories": 1, "steps": 2, "token_arrays": 3, "late": 0}
    with engine.connect() as c:
        row = c.execute(text("SELECT a.response_ids, a.loss_mask, a.logprobs, s.model_response FROM token_arrays a "
                             "JOIN trajectories t ON t.id = a.trajectory_id JOIN steps s ON s.trajectory_id = t.id "
                             "AND s.step_idx = 0 WHERE t.run_id = :r AND a.step_idx = -1"), {"r": run}).one()
    assert row[0] == [4, 5, 9, 4, 5] and row[1] == [1, 1, 0, 1, 1] and row[2][0] == pytest.approx(-0.5)
    assert row[3] == "ok"  # NUL stripped: Postgres text cannot hold it


@pytest.mark.parametrize("method", ["copy", "values"])
def test_batch_of_many_episodes(engine, method):
    store = TrajectoryStore(engine, method=method)
    run = new_run(engine)
    keys = [(f"t{i}", s, 0) for i in range(100) for s in range(3)]
    dispatch(engine, run, keys)
    out = store.write([result(run, t, s, a, steps=3) for t, s, a in keys])
    assert out.stored == 300 and out.rows == 300 * (1 + 1 + 3 + 1)
    assert counts(engine, run) == {"episodes": 300, "trajectories": 300, "steps": 900, "token_arrays": 1200,
                                   "late": 0}
    with engine.connect() as c:
        assert ledger_summary(c, run) == {"dispatched": 300, "in_flight": 0, "completed": 300, "error": 0,
                                          "failed": 0, "lost": 0, "cancelled": 0, "finished": 300}


def test_late_result_is_an_event_not_a_trajectory(engine):
    store = TrajectoryStore(engine)
    run = new_run(engine)
    dispatch(engine, run, [("t0", 0, 0), ("t0", 0, 1)])
    with engine.begin() as c:  # the controller gave up on attempt 0 and re-dispatched attempt 1
        c.execute(update(RolloutTaskRow).where(RolloutTaskRow.attempt == 0,
                                               RolloutTaskRow.run_id == uuid.UUID(run)).values(status="lost"))
    assert store.write([result(run, "t0", 0, 1)]).stored == 1
    late = store.write([result(run, "t0", 0, 0)])
    assert late.stored == 0 and late.late == [(run, "t0", 0, 0)]
    store.write([result(run, "t0", 0, 0)])  # the late message re-delivered: still one event
    never = store.write([result(run, "t9", 0, 0)])  # no ledger row at all
    assert never.late == [(run, "t9", 0, 0)]
    assert counts(engine, run) == {"episodes": 1, "trajectories": 1, "steps": 2, "token_arrays": 3, "late": 2}
    with engine.connect() as c:
        kinds = c.execute(select(RunEvent.data).where(RunEvent.run_id == uuid.UUID(run))).scalars().all()
    assert {"task_id": "t0", "sample_idx": 0, "attempt": 0, "result_status": "completed"} in kinds


def test_failed_result_marks_ledger_failed(engine):
    store = TrajectoryStore(engine)
    run = new_run(engine)
    dispatch(engine, run, [("t0", 0, 0), ("t1", 0, 0)])
    out = store.write([result(run, "t0", status="failed"), result(run, "t1")])
    assert (out.failed, out.stored) == (1, 1)
    with engine.connect() as c:
        err = c.execute(select(RolloutTaskRow.error).where(RolloutTaskRow.task_id == "t0",
                                                           RolloutTaskRow.run_id == uuid.UUID(run))).scalar_one()
        summary = ledger_summary(c, run)
    assert err == "env session lost"
    assert summary == {"dispatched": 2, "in_flight": 0, "completed": 1, "error": 0, "failed": 1, "lost": 0,
                       "cancelled": 0, "finished": 2}
    assert counts(engine, run)["trajectories"] == 1  # the failed attempt's episode row only, no trajectory


def test_user_code_error_is_its_own_outcome_never_trained_on(engine):
    """status="error": the ledger row ends `error` with the error's first line ("<where>: <what>"), the episode
    keeps the whole error and its trajectories (to read what happened), and nothing goes to the trainer."""
    store = TrajectoryStore(engine)
    run = new_run(engine, kind="train")
    dispatch(engine, run, [("t0", 0, 0), ("t1", 0, 0)])
    errored = result(run, "t0").model_copy(update={
        "status": "error", "termination_reason": TerminationReason.ERROR,
        "error": "env math.reset: KeyError: 'answer'\nTraceback (most recent call last):\n  ...\nKeyError: 'answer'"})
    out = store.write([errored, result(run, "t1")])
    assert (out.errored, out.stored, out.failed) == (1, 1, 0)
    assert [r.task_id for r in out.to_train] == ["t1"]
    with engine.connect() as c:
        ledger = dict(c.execute(select(RolloutTaskRow.task_id, RolloutTaskRow.error).where(
            RolloutTaskRow.run_id == uuid.UUID(run))).all())
        episode = c.execute(text("SELECT status, error FROM episodes WHERE run_id = :r AND task_id = 't0'"),
                            {"r": run}).one()
        summary = ledger_summary(c, run)
    assert ledger["t0"] == "env math.reset: KeyError: 'answer'"
    assert episode.status == "error" and episode.error.endswith("KeyError: 'answer'") and "Traceback" in episode.error
    assert summary["error"] == 1 and summary["completed"] == 1 and summary["finished"] == 2
    assert counts(engine, run)["trajectories"] == 2
    assert store.write([errored]).duplicates == 1  # re-delivered: applied once


def test_only_what_the_store_accepted_is_handed_to_the_trainer(engine):
    """`to_train` (published to `results.accepted`) holds the accepted completed results of training runs, and
    re-deliveries of stored attempts (their first publish may have been lost); never a late result, a failed
    one, or an eval run's."""
    store = TrajectoryStore(engine)
    run, evaluation = new_run(engine, kind="train"), new_run(engine)
    dispatch(engine, run, [("t0", 0, 0), ("t0", 0, 1), ("t1", 0, 0), ("t2", 0, 0)])
    dispatch(engine, evaluation, [("t0", 0, 0)])
    with engine.begin() as c:  # attempt 0 of t0 expired: the controller marked it lost
        c.execute(update(RolloutTaskRow).where(RolloutTaskRow.attempt == 0, RolloutTaskRow.task_id == "t0",
                                               RolloutTaskRow.run_id == uuid.UUID(run)).values(status="lost"))
    first, zombie = result(run, "t1"), result(run, "t0", 0, 0)
    out = store.write([zombie, first, result(run, "t1"), result(run, "t2", status="failed"),
                       result(run, "t0", 0, 1), result(evaluation, "t0")])
    assert out.late == [zombie.key] and out.stored == 3 and out.failed == 1
    assert [r.key for r in out.to_train] == [first.key, (run, "t0", 0, 1)]
    assert out.to_train[0] is first  # the copy that was stored, not the in-batch repeat
    again = store.write([result(run, "t1"), zombie])  # re-delivered: the stored one is handed over again
    assert [r.key for r in again.to_train] == [first.key] and again.late == [zombie.key]


@pytest.mark.parametrize("method", ["copy", "values"])
def test_the_sequences_of_a_rewritten_trajectory_keep_their_turn_numbers(engine, method):
    """An agent that rewrote its history after turn 2 of 3: two sequences, stored as two trajectory rows whose
    steps are numbered 0, 1 and 2 (their turns in the whole episode), so per-turn SQL reads as if uncut."""
    store = TrajectoryStore(engine, method=method)
    run = new_run(engine)
    dispatch(engine, run, [("t0", 0, 0)])
    msg = result(run, "t0", steps=3)
    whole = msg.trajectories[0]
    parts = [whole.model_copy(update={"uid": f"{whole.uid}/{k}", "steps": steps,
                                      "info": {"sequence": k, "sequences": 2, "first_turn": first}})
             for k, (first, steps) in enumerate([(0, whole.steps[:2]), (2, whole.steps[2:])])]
    assert store.write([msg.model_copy(update={"trajectories": parts})]).stored == 1
    with engine.connect() as c:
        rows = c.execute(text("SELECT t.info->>'sequence', s.step_idx FROM steps s JOIN trajectories t ON "
                              "t.id = s.trajectory_id WHERE t.run_id = :r ORDER BY 2"), {"r": run}).all()
    assert [tuple(r) for r in rows] == [("0", 0), ("0", 1), ("1", 2)]


@pytest.mark.parametrize(("method", "compact"), [("copy", False), ("values", False), ("copy", True)])
def test_the_views_rebuild_every_step_exactly_from_what_is_stored_once(engine, method, compact):
    """`steps` and `token_arrays` read as if every step were stored whole (its chat so far, its prompt, response
    and logprobs), though the stream and each message are stored once: with a chat rewritten at turn 5 and a
    retokenized prompt at turn 7, sent whole or compact (as rollout workers send it). Stored bytes grow
    linearly: no stored step holds a prompt."""
    store = TrajectoryStore(engine, method=method)
    run = new_run(engine)
    dispatch(engine, run, [("t0", 0, 0)])
    whole = multi_turn(12, rewrite_at=5, off_stream=7)
    msg = decode(encode(EpisodeResult(run_id=run, task_id="t0", sample_idx=0, status="completed",
                                      termination_reason="env_done",
                                      trajectories=[whole.compact() if compact else whole])))
    assert store.write([msg]).stored == 1
    traj = msg.trajectories[0].expanded()
    with engine.connect() as c:
        steps = c.execute(text("SELECT s.step_idx, s.chat_completions, a.prompt_ids, a.response_ids, a.logprobs "
                               "FROM steps s JOIN trajectories t ON t.id = s.trajectory_id JOIN token_arrays a "
                               "ON a.trajectory_id = t.id AND a.step_idx = s.step_idx WHERE t.run_id = :r "
                               "ORDER BY 1"), {"r": run}).all()
        stored = c.execute(text("SELECT a.step_idx FROM token_streams a JOIN trajectories t ON t.id = "
                                "a.trajectory_id WHERE t.run_id = :r ORDER BY 1"), {"r": run}).scalars().all()
        messages = c.execute(text("SELECT sum(jsonb_array_length(s.chat_added)) FROM step_records s JOIN "
                                  "trajectories t ON t.id = s.trajectory_id WHERE t.run_id = :r"), {"r": run}).scalar()
    assert [r.step_idx for r in steps] == list(range(12))
    for r, s in zip(steps, traj.steps, strict=True):
        assert r.chat_completions == s.chat_completions, r.step_idx
        assert (r.prompt_ids, r.response_ids) == (s.prompt_ids, s.response_ids), r.step_idx
        assert r.logprobs == pytest.approx(s.logprobs, abs=1e-6), r.step_idx
    assert stored == [-1, 7]  # the stream, and the one step that is not a slice of it
    assert messages == 2 * 12  # each message once (turn 5 stored its whole chat: the summary and its answer)
