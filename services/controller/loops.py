"""The controller: one process drives many runs; each run is driven by whichever controller holds its
controller lease (shared/platform/leases.py). It is the one writer of `runs` and `run_events`.

Seven loops, one module each: dispatch (dispatch.py, the only loop that changes the drivers' dispatch state;
the others hand it what they learn and wake it), store (ingest.py), progress (progress.py), reconcile
(reconcile.py), commands (command_loop.py), control (control_loop.py), trim (trim.py). Postgres reads and
writes are in run_rows.py (runs, leases, events), run_commands.py, ledger.py (rollout_tasks), run_summary.py,
trainer_groups.py, dataset_rows.py and store.py (the trajectories).

More: docs/architecture.md#the-controller
"""

from __future__ import annotations

import asyncio

from sqlalchemy import Engine

from services.controller import run_rows
from services.controller.command_loop import CommandLoop
from services.controller.control_loop import ControlLoop
from services.controller.dispatch import DispatchLoop
from services.controller.ingest import IngestLoop
from services.controller.progress import ProgressLoop
from services.controller.reconcile import ReconcileLoop
from services.controller.run_driver import RunDriver
from services.controller.settings import ControllerSettings
from services.controller.trim import trim_loop
from shared.platform.bus import StreamBus


class Controller:
    def __init__(self, cfg: ControllerSettings, worker_id: str, db: Engine, bus: StreamBus):
        self.cfg, self.worker_id, self.db, self.bus = cfg, worker_id, db, bus
        self.drivers: dict[str, RunDriver] = {}  # the runs this controller holds the lease of, by id
        self.wake = asyncio.Event()  # results stored or progress reported: dispatch again now
        self.status: dict = {}  # reported by /healthz and the heartbeat (the runs driven)
        self.dispatch = DispatchLoop(cfg, worker_id, db, bus, self.drivers, self.wake, self.status)
        self.ingest = IngestLoop(cfg, worker_id, db, bus, self.drivers, self.wake)
        self.progress = ProgressLoop(cfg, worker_id, db, bus, self.drivers, self.wake)
        self.reconcile = ReconcileLoop(cfg, worker_id, db, bus)
        self.commands = CommandLoop(cfg, worker_id, db, bus, self.wake)
        self.control = ControlLoop(bus, self.drivers, self.wake)

    def loops(self, stop: asyncio.Event) -> list:
        return [self.dispatch.run(stop), self.ingest.run(stop), self.progress.run(stop), self.reconcile.run(stop),
                self.commands.run(stop), self.control.run(stop), trim_loop(self.bus, self.cfg.trim_interval_s, stop)]

    async def close(self) -> None:
        """Release the run leases: another controller takes the runs over at once instead of at expiry."""
        await asyncio.to_thread(run_rows.release_runs, self.db, self.worker_id)
