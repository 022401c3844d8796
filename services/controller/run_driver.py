"""One run's dispatch state: which slots (task, sample) are in flight, scored, errored, to retry or finally
failed. A slot whose attempt ended `error` (the user's code failed) is final: not retried, never scored.

Built from the ledger when a controller takes the run (so a restarted controller redoes nothing stored and
skips nothing lost), then kept current from ledger rows that ended. Pure bookkeeping: no I/O here.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass, field

from services.controller.ledger import LedgerRow
from services.controller.plan import Plan, Slot
from services.controller.run_rows import RunRow
from shared.contracts.run_config import RunConfig

BAD = ("failed", "lost")  # attempts that count against max_attempts
SlotKey = tuple[str, int]


@dataclass
class SlotState:
    slot: Slot
    attempt: int  # latest attempt
    status: str  # ledger status of the latest attempt
    bad: int = 0  # failed or lost attempts so far
    dispatched_at: float = field(default_factory=time.monotonic)  # of the latest attempt (or when the ledger was read)


class RunDriver:
    def __init__(self, run: RunRow, cfg: RunConfig, tasks: list[tuple[str, dict, str]]):
        self.run_id, self.cfg = run.id, cfg
        self.status, self.policy_version = run.status, run.policy_version
        self.status_version = run.status_version  # runs.status_version of `status` (control_loop.py)
        self.plan = Plan(cfg, [t[0] for t in tasks])
        self.task_data = {t[0]: t[1] for t in tasks}
        self.states: dict[SlotKey, SlotState] = {}
        self.in_flight: set[SlotKey] = set()
        self.retry: dict[SlotKey, None] = {}  # insertion-ordered set
        self.final_failed: set[SlotKey] = set()
        self.num_completed = 0
        self.cursor = (0, 0)  # (batch, index within batch) of the next never-dispatched slot
        self.dropped_groups = 0  # groups consumed without a step (trainer drops, final failures): refilled
        self.stopping_since: float | None = None
        self.withdrawn: list[tuple[str, int, int]] | None = None  # queued tasks taken back at stop (once)
        self.stale = False  # the ledger has rows this driver did not put there: rebuild
        self.stored_here: list[tuple] = []  # (task, sample, attempt, status, error) our store loop ended, unapplied
        self.next_ledger_scan = 0.0  # monotonic time of the next read of ended ledger rows
        self.recount_dropped = False  # the trainer reported dropped groups since the last count
        self.trainer_error: str | None = None  # a trainer reported it cannot train this run (trainer.progress)
        self.notices: list = []  # AcceptedResult notices of final failures, published after their commit
        self.unpublished: list = []  # RolloutTasks committed to the ledger whose XADD has not succeeded yet
        self.published: list[tuple[str, int, int]] = []  # keys published, marked so in the ledger at the next pass
        self.errored: set[SlotKey] = set()  # slots whose user code failed (final, not scored)
        self.failure_streak: dict[str, int] = {}  # reason -> failed/errored attempts since the last completed one
        self.fail_reason: str | None = None  # set once a reason's streak reaches the run's fail-fast threshold
        # Fail fast scales with the run: never waits for more attempts than the run's first dispatch window.
        window = self.plan.first_window_slots()
        self.fail_fast_failures = cfg.fail_fast_after or min(max(20, 2 * cfg.max_in_flight), window)
        self.fail_fast_errors = min(cfg.fail_fast_after_errors, window)
        self.stall_reason: str | None = "?"  # last written to runs.stall_reason ("?": not yet, write once)
        self.signal_checked_version = -1  # policy version the no-learning-signal warning was last checked at
        self.last_progress = 0.0  # monotonic time a ledger row last ended or the policy version moved (0: unset)
        self.unit_s = 0.0  # the longest recent dispatch-to-end time of a unit (decaying): sizes the stall window

    # -- ledger -> state ----------------------------------------------------------------------------------------
    def rebuild(self, rows: list[LedgerRow]) -> None:
        """Rows ordered by attempt: the last row seen for a slot is its latest attempt."""
        for r in rows:
            st = self.states.setdefault(
                (r.task_id, r.sample_idx),
                SlotState(Slot(r.task_id, r.sample_idx, r.batch_idx, r.epoch, r.greedy), r.attempt, r.status),
            )
            st.attempt, st.status = r.attempt, r.status
            st.bad += r.status in BAD
        for key, st in self.states.items():
            self._settle(key, st)

    def apply(self, task_id: str, sample_idx: int, attempt: int, status: str, error: str | None = None) -> bool:
        """A ledger row ended (`error`: why, for a failed or lost attempt). Returns True when that made the slot
        a final failure."""
        key = (task_id, sample_idx)
        st = self.states.get(key)
        if st is None or st.attempt != attempt or st.status != "dispatched":
            return False
        st.status = status
        st.bad += status in BAD
        if status in ("completed", "error"):  # how long a unit takes now: a loaded machine stretches it
            self.unit_s = max(0.9 * self.unit_s, time.monotonic() - st.dispatched_at)
        self.in_flight.discard(key)
        self._track_failures(status, error)
        return self._settle(key, st)

    @property
    def num_errored(self) -> int:
        return len(self.errored)

    def _track_failures(self, status: str, error: str | None) -> None:
        """Fail fast: attempts failing again and again for one reason (a model path that does not exist, an
        engine the workers lack, an env whose reset always raises) will not start succeeding; a completed
        attempt resets every streak. Infrastructure failures and user-code errors have their own thresholds.
        A lost attempt (its lease expired) says nothing of the run: its workers died or Redis lost the task, and
        the stack heals from both, so it neither counts nor resets."""
        if status == "completed":
            self.failure_streak.clear()
        elif status in ("failed", "error"):
            reason = outcome_reason(status, error)
            key = ("error: " if status == "error" else "") + re.sub(r"0x[0-9a-fA-F]+|\d+", "#", reason)
            self.failure_streak[key] = self.failure_streak.get(key, 0) + 1
            limit = self.fail_fast_errors if status == "error" else self.fail_fast_failures
            if self.failure_streak[key] >= limit and self.fail_reason is None:
                what = "units in a row ended in a user-code error" if status == "error" else "attempts in a row failed"
                self.fail_reason = f"{self.failure_streak[key]} {what}: {reason}"

    def _settle(self, key: SlotKey, st: SlotState) -> bool:
        if st.status == "dispatched":
            self.in_flight.add(key)
        elif st.status == "completed":
            self.num_completed += 1
        elif st.status == "error":  # the user's code failed: final, its group can never complete
            self.errored.add(key)
            return True
        elif st.status == "cancelled" or (st.status in BAD and st.bad < self.cfg.max_attempts):
            self.retry[key] = None  # cancelled: re-run only if a stopped run is resumed
        else:
            self.final_failed.add(key)
            return True
        return False

    # -- what to dispatch ---------------------------------------------------------------------------------------
    def next_items(self, limit: int) -> list[tuple[Slot, int]]:
        """Up to `limit` (slot, attempt) pairs: retries first, then new slots inside the staleness window."""
        items = [(self.states[k].slot, self.states[k].attempt + 1) for k in list(self.retry)[:limit]]
        end = self.plan.group_limit(self.policy_version, self.dropped_groups)
        b, i = self.cursor
        while len(items) < limit:
            batch = self.plan.batch(b)
            if i >= len(batch):
                b, i = b + 1, 0
                continue
            if self.plan.group_index(b, i) >= end:
                break
            if batch[i].key not in self.states:
                items.append((batch[i], 0))
            i += 1
        self.cursor = (b, i)
        return items

    def mark_dispatched(self, items: list[tuple[Slot, int]], inserted: set[tuple[str, int, int]]) -> None:
        for slot, attempt in items:
            if (slot.task_id, slot.sample_idx, attempt) not in inserted:
                continue
            prev = self.states.get(slot.key)
            self.states[slot.key] = SlotState(slot, attempt, "dispatched", prev.bad if prev else 0)
            self.retry.pop(slot.key, None)
            self.in_flight.add(slot.key)

    def final_failed_groups(self) -> list[tuple[str, int]]:
        """(task_id, batch_idx) of each finally failed or errored slot: a group that can never complete."""
        return [(k[0], self.states[k].slot.batch_idx) for k in self.final_failed | self.errored]

    def has_undispatched(self) -> bool:
        """Whether the dispatch window holds a slot never dispatched (without moving the cursor)."""
        b, i = self.cursor
        if i >= len(self.plan.batch(b)):
            b, i = b + 1, 0
        return self.plan.group_index(b, i) < self.plan.group_limit(self.policy_version, self.dropped_groups)

    def in_flight_keys(self) -> list[tuple[str, int, int]]:
        return [(k[0], k[1], self.states[k].attempt) for k in self.in_flight]

    def nothing_scored(self) -> bool:
        """A training run whose first window of units all ended without one scored result. Its trainer never
        steps, so it would never be done: failed groups are refilled from later epochs, and attempts keep ending
        (never a stall), whatever mix of reasons keeps every fail-fast streak short. An eval run ends anyway."""
        ended = len(self.final_failed) + len(self.errored)
        return not self.plan.is_eval and self.num_completed == 0 and ended >= self.plan.first_window_slots()

    @property
    def is_done(self) -> bool:
        """Eval: every slot completed or finally failed. Train: the trainer reached the planned steps."""
        if self.plan.is_eval:
            return self.num_completed + len(self.final_failed) + len(self.errored) == len(self.plan.batch(0))
        return self.policy_version >= self.plan.planned_steps


def failure_reason(error: str) -> str:
    """The line of an error that says what went wrong: a traceback's last line, at most 500 characters."""
    lines = [line.strip() for line in error.strip().splitlines() if line.strip()]
    return (lines[-1] if lines else error)[:500]


def outcome_reason(status: str, error: str | None) -> str:
    """Why an attempt ended unscored, in one line. A user-code error's first line says where and what
    ("env math.reset: ValueError: ..."); an infrastructure failure's traceback ends with what."""
    if status == "error" and error:
        return error.strip().split("\n", 1)[0][:500]
    return failure_reason(error or status)
