"""What the dispatch pass does to a run inside its transaction, besides dispatching: apply ledger rows that
ended (recording final failures), and move the run's status: stopping -> stopped (cancelling what is queued or
in flight), fail fast, completed (with its summary; pass@k for an eval run). Each status change is a
compare-and-set on the status the driver last read, so an API change made meanwhile wins."""

from __future__ import annotations

import time

from prometheus_client import Counter
from sqlalchemy import Connection

from services.controller import dataset_rows, ledger, run_rows, run_summary
from services.controller.run_driver import RunDriver
from shared.contracts.messages import AcceptedResult
from shared.contracts.passk import pass_at_k_table
from shared.platform.logs import get_logger

log = get_logger(__name__)
FINAL_FAILURES = Counter("controller_final_failures_total", "(task, sample) slots out of attempts")


def ended(conn: Connection, d: RunDriver, task_id: str, sample_idx: int, attempt: int, status: str,
          error: str | None = None) -> None:
    """A ledger row ended: update the driver; a slot now out of attempts gets its `final_failure` event."""
    d.last_progress = time.monotonic()
    if d.apply(task_id, sample_idx, attempt, status, error):
        if status == "error":  # the ledger row says why; the trainer still must drop the group
            group_cannot_complete(d, task_id, sample_idx, attempt)
            return
        FINAL_FAILURES.inc()
        final_failure_event(conn, d, task_id, sample_idx, attempt)


def final_failure_event(conn: Connection, d: RunDriver, task_id: str, sample_idx: int, attempt: int) -> None:
    run_rows.add_event(conn, d.run_id, "final_failure", f"{task_id}/{sample_idx} is out of attempts ({attempt + 1})",
                      {"task_id": task_id, "sample_idx": sample_idx, "attempt": attempt}, once=True)
    group_cannot_complete(d, task_id, sample_idx, attempt)


def group_cannot_complete(d: RunDriver, task_id: str, sample_idx: int, attempt: int) -> None:
    """Queue the notice telling the trainer to drop the slot's group (a training run's); it is published once
    the transaction commits (DispatchLoop.announce_final_failures)."""
    if not d.plan.is_eval:
        slot = d.states[(task_id, sample_idx)].slot
        d.notices.append(AcceptedResult(run_id=d.run_id, task_id=task_id, sample_idx=sample_idx,
                                        attempt=attempt, batch_idx=slot.batch_idx, greedy=slot.greedy))


def stopping(conn: Connection, d: RunDriver, stop_timeout_s: float) -> None:
    """Stop dispatching; cancel the tasks taken back from the stream (no worker had started them); wait for
    the others up to stop_timeout_s, then cancel and record them."""
    if d.withdrawn:
        keys = ledger.cancel_dispatched(conn, d.run_id, d.withdrawn, "run stopped before a worker took the task")
        d.withdrawn = []
        for key in keys:
            ended(conn, d, *key, "cancelled")
        if keys:
            run_rows.add_event(conn, d.run_id, "cancelled", f"{len(keys)} queued tasks withdrawn at stop",
                              {"count": len(keys), "queued": True})
    d.stopping_since = d.stopping_since or time.monotonic()
    if d.in_flight and time.monotonic() - d.stopping_since < stop_timeout_s:
        return
    cancelled = ledger.cancel_in_flight(conn, d.run_id)
    if cancelled:
        run_rows.add_event(conn, d.run_id, "cancelled", f"{cancelled} in-flight tasks cancelled at stop",
                          {"count": cancelled})
    if run_rows.set_status(conn, d.run_id, "stopping", "stopped"):
        d.status = "stopped"


def fail(conn: Connection, d: RunDriver) -> None:
    """Fail fast (RunDriver._track_failures): stop dispatching, cancel what is in flight, and say why."""
    cancelled = ledger.cancel_in_flight(conn, d.run_id)
    if run_rows.set_status(conn, d.run_id, d.status, "failed", error=d.fail_reason):
        log.warning("run failed: %s (%d in-flight tasks cancelled)", d.fail_reason, cancelled,
                    extra={"run_id": d.run_id})
        d.status = "failed"


def nothing_scored_reason(d: RunDriver, reasons: list[dict]) -> str:
    """Why a run none of whose units scored fails: how its units ended, and the most common reason."""
    units = f"{len(d.errored)} errored, {len(d.final_failed)} out of attempts"
    why = (f"; most common reason ({reasons[0]['count']} attempts, {reasons[0]['status']}): "
           f"{reasons[0]['reason']}") if reasons else ""
    return f"no unit produced a scored result ({units}){why}"


def complete(conn: Connection, d: RunDriver) -> None:
    """Every unit ended (eval) or the planned steps are trained. A run none of whose units produced a scored
    result fails instead, with the reason most of them failed for: "completed" would read as "the model
    scores 0"."""
    reasons = run_summary.top_reasons(conn, d.run_id)
    summary = {"ledger": run_summary.ledger_summary(conn, d.run_id),
               "requeued": run_summary.requeued_units(conn, d.run_id), "final_failures": len(d.final_failed),
               "scored": d.num_completed, "errored": d.num_errored, "top_reasons": reasons}
    if d.plan.is_eval:
        summary.update(pass_at_k_table(dataset_rows.eval_samples(conn, d.run_id, d.cfg.dataset,
                                                                 d.cfg.dataset_split, d.cfg.dataset_version)))
    run_summary.write_summary(conn, d.run_id, summary)
    if d.num_completed == 0:
        d.fail_reason = nothing_scored_reason(d, reasons)
        fail(conn, d)
    elif run_rows.set_status(conn, d.run_id, "running", "completed"):
        d.status = "completed"
