"""Trainer checkpoints: STATE_DIR/<run>/step_<version>/ holds verl's sharded model + optimizer state and
STEP.json (which samples that step consumed, its metrics). A step folder is written as `.step_<v>.tmp`,
fsynced and renamed; the rename is the completion marker, so a half-written checkpoint is never picked up."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from pydantic import BaseModel

from services.trainer.engine import PolicyEngine
from shared.weights.manifest import fsync_path, fsync_tree

MARKER = "STEP.json"


class SampleRecord(BaseModel):
    task_id: str
    sample_idx: int
    attempt: int
    status: str  # used | baseline | stale | filtered | incomplete | excluded | abandoned
    generated_version: int | None = None
    batch_idx: int | None = None  # with task_id, the sample's group


class StepRecord(BaseModel):
    run_id: str
    version: int
    samples: list[SampleRecord]
    metrics: dict[str, float]


class CheckpointDir:
    def __init__(self, root: Path, run_id: str, keep: int = 2):
        self.root, self.run_id, self.keep = root / run_id, run_id, keep
        self.root.mkdir(parents=True, exist_ok=True)

    def save(self, engine: PolicyEngine, record: StepRecord) -> Path:
        tmp = self.root / f".step_{record.version}.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        engine.save(tmp, record.version)
        (tmp / MARKER).write_text(record.model_dump_json())
        fsync_tree(tmp)
        final = self.root / f"step_{record.version}"
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        fsync_path(self.root)
        self._prune()
        return final

    def latest(self) -> tuple[Path, StepRecord] | None:
        """The newest complete checkpoint (folders without the marker are leftovers of a crash)."""
        steps = sorted((int(p.name.split("_")[1]), p) for p in self.root.glob("step_*") if (p / MARKER).is_file())
        if not steps:
            return None
        path = steps[-1][1]
        return path, StepRecord.model_validate_json((path / MARKER).read_text())

    def _prune(self) -> None:
        for tmp in self.root.glob(".step_*.tmp"):
            shutil.rmtree(tmp, ignore_errors=True)
        steps = sorted((int(p.name.split("_")[1]), p) for p in self.root.glob("step_*"))
        for _, path in steps[:-self.keep]:
            shutil.rmtree(path, ignore_errors=True)
