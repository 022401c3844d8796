"""One run's life through its experiment trackers, as the tracker tests drive it (unit: TensorBoard and failing
trackers; component: W&B and MLflow, whose libraries start processes)."""

from __future__ import annotations

import uuid
from pathlib import Path

from services.trainer.settings import TrainerSettings
from services.trainer.tracking import RunTrackers, resolve
from shared.contracts.run_config import RunConfig

METRICS = {1: {"reward_mean": 0.25, "pass_rate": 0.5, "loss": 1.5, "trajectories_per_s": 3.0, "staleness_0": 8.0},
           2: {"reward_mean": 0.75, "pass_rate": 1.0, "loss": 0.5, "trajectories_per_s": 4.0, "staleness_1": 8.0}}
SUMMARY = {"status": "completed", "policy_version": 2}


def tracked_config(**tracking) -> RunConfig:
    return RunConfig(name="tracked run", model="m", dataset="d", agent={"name": "math"}, env={"name": "math"},
                     samples_per_task=2, algorithm={"lr": 3e-4}, tracking=tracking)


def track(config: RunConfig, tmp_path: Path, kinds: dict | None = None, **settings) -> tuple[str, RunTrackers]:
    """One run's life through its trackers: start, versions 1 and 2, then its end."""
    run_id = str(uuid.uuid4())
    trackers = RunTrackers(run_id, config, resolve(config, TrainerSettings(data_dir=tmp_path, **settings)), kinds)
    trackers.start()
    for version, metrics in METRICS.items():
        trackers.log(metrics, version)
    trackers.finish(SUMMARY)
    assert trackers.join(120), "the trackers' calls did not end in 120 s"
    return run_id, trackers


def tensorboard_scalars(folder: Path) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(folder))
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}
