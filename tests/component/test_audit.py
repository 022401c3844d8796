"""run_accounting counts lost and doubled work correctly from real Postgres rows."""

from __future__ import annotations

import uuid

from sqlalchemy import create_engine

from shared.contracts.db.models import EpisodeRow, RolloutTaskRow, Run, RunEvent
from shared.platform.db.session import session_factory
from tests.support.audit import run_accounting


def _episode(run_id, task, sample, attempt, status="completed"):
    return EpisodeRow(run_id=run_id, task_id=task, sample_idx=sample, attempt=attempt, status=status,
                      termination_reason="env_done")


def test_accounting_counts_each_outcome(database_url):
    engine = create_engine(database_url)
    run_id = uuid.uuid4()
    with session_factory(engine)() as s:
        s.add(Run(id=run_id, name="audit", kind="eval", status="running", config={}))
        s.flush()
        slots = {  # (task, sample): attempts dispatched
            ("a", 0): 1, ("b", 0): 2, ("c", 0): 3, ("d", 0): 1, ("e", 0): 2, ("f", 0): 1, ("g", 0): 1,
        }
        for (task, sample), n in slots.items():
            for attempt in range(n):
                s.add(RolloutTaskRow(run_id=run_id, task_id=task, sample_idx=sample, attempt=attempt))
        s.add_all([
            _episode(run_id, "a", 0, 0),  # stored once: fine
            _episode(run_id, "b", 0, 0, status="failed"), _episode(run_id, "b", 0, 1),  # retried, stored
            _episode(run_id, "e", 0, 0), _episode(run_id, "e", 0, 1),  # zombie: two attempts stored
            _episode(run_id, "f", 0, 0),  # stored AND recorded as failed
            _episode(run_id, "g", 0, 0, status="error"),  # the user's code failed: final, not lost
        ])
        s.add_all([  # c ran out of attempts (recorded); d has nothing at all (lost)
            RunEvent(run_id=run_id, kind="final_failure", data={"task_id": "c", "sample_idx": 0}),
            RunEvent(run_id=run_id, kind="final_failure", data={"task_id": "f", "sample_idx": 0}),
            RunEvent(run_id=run_id, kind="late_result", data={}),
        ])
        s.commit()
        counts = run_accounting(s, run_id)
    engine.dispose()
    assert counts == {
        "dispatched": 7, "stored": 4, "errored": 1, "failed_recorded": 1, "lost": 1, "duplicates": 2,
        "late_results": 1,
    }
