"""The trainer service with a crash injected by the test, not by production code:
`FAULT_POINT=<phase>:<version> python tests/e2e/trainer/trainer_with_fault.py` runs `services.trainer.main`
and SIGKILLs the process at that point of step `version`:

- trained: the step is trained, before its checkpoint is saved;
- checkpointed: the checkpoint is in place, before the step is recorded in Postgres;
- committed: the step is recorded, before its weights are published.
"""

from __future__ import annotations

import os
import signal
import sys

from services.trainer import run_store as runs
from services.trainer.loop import Trainer
from services.trainer.main import main
from services.trainer.state import CheckpointDir

PHASE, _, VERSION = os.environ["FAULT_POINT"].partition(":")


def _kill_at(version: int) -> None:
    if version == int(VERSION):
        print(f"test fault: SIGKILL at {PHASE}:{version}", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)


def _before(fn, version_of):
    def wrapped(*args, **kwargs):
        _kill_at(version_of(*args, **kwargs))
        return fn(*args, **kwargs)
    return wrapped


if PHASE == "trained":
    CheckpointDir.save = _before(CheckpointDir.save, lambda self, engine, record: record.version)
elif PHASE == "checkpointed":
    runs.commit_step = _before(runs.commit_step, lambda db, record: record.version)
elif PHASE == "committed":
    Trainer._publish = _before(Trainer._publish, lambda self, run_id, engine, version, metrics: version)
else:
    raise SystemExit(f"FAULT_POINT phase must be trained, checkpointed or committed, got {PHASE!r}")

if __name__ == "__main__":
    sys.exit(main())
