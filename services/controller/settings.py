"""Controller settings (environment variables, e.g. POLL_INTERVAL_S=0.5)."""

from __future__ import annotations

from pydantic import Field, model_validator

from shared.platform.settings import ServiceSettings


class ControllerSettings(ServiceSettings):
    service_name: str = "controller"
    poll_interval_s: float = Field(0.5, gt=0, description="how often the runs table is read (status, policy "
                                   "version) and run leases renewed, seconds")
    dispatch_interval_s: float = Field(0.1, gt=0, description="longest wait between dispatch passes when no "
                                       "stored result wakes the loop earlier, seconds")
    run_lease_s: float = Field(15.0, gt=0, description="lease on a runs row; another controller takes the run "
                               "over once it expires, seconds")
    ledger_lease_margin_s: float = Field(30.0, ge=0, description="added to the run's trajectory_timeout_s to "
                                         "form a dispatched task's lease, after which it is marked lost, seconds")
    reconcile_interval_s: float = Field(2.0, gt=0, description="lost-task and dead-letter scan period, seconds")
    trim_interval_s: float = Field(10.0, gt=0, description="trim of acknowledged stream entries, seconds")
    stop_timeout_s: float = Field(60.0, ge=0, description="a stopping run waits this long for in-flight "
                                  "tasks, then cancels them, seconds")
    store_batch_size: int = Field(256, ge=1, description="trajectory messages written per transaction")
    store_claim_idle_ms: int = Field(30_000, ge=1, description="idle time before a dead store consumer's "
                                     "entries are reclaimed, milliseconds")
    max_runs: int = Field(64, ge=0, description="runs one controller drives at once (0: none; it still applies "
                          "run commands and stores results)")
    rollout_capacity: int | None = Field(
        None, ge=1, description="rollout tasks in flight across all running runs this controller drives, shared "
        "between them by their `priority` (set it to the rollout workers' total MAX_CONCURRENCY, so one slow run "
        "cannot queue the others behind it); unset: the MAX_CONCURRENCY live rollout workers advertise in their "
        "heartbeats, once two or more runs dispatch")
    stall_after_s: float = Field(60.0, gt=0, description="a running run with no attempt ended and no new policy "
                                 "version for this long is stalled: the controller finds out why and puts it in "
                                 "the run's stall_reason (API, CLI, dashboard), seconds")
    no_signal_versions: int = Field(3, ge=1, description="a training run whose every group had equal rewards "
                                    "(zero advantage: nothing learned) for this many policy versions in a row "
                                    "gets a warning in its status, versions")
    store_method: str = Field("copy", description="'copy' (binary COPY + INSERT SELECT) or 'values'")

    @model_validator(mode="after")
    def _check(self) -> ControllerSettings:
        if self.run_lease_s <= 2 * self.poll_interval_s:
            raise ValueError("RUN_LEASE_S must exceed twice POLL_INTERVAL_S, or leases lapse between renewals")
        if self.store_method not in ("copy", "values"):
            raise ValueError(f"STORE_METHOD must be 'copy' or 'values', got {self.store_method!r}")
        return self
