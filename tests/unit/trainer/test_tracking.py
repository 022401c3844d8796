"""Experiment trackers offline: TensorBoard's event files read back through its EventAccumulator; a tracker that
fails (server down, not installed, a write that raises) is counted and warned about, and the others go on; the
tracking config. W&B and MLflow, whose libraries start processes: tests/component/test_tracking_stores.py.
"""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest
from pydantic import ValidationError

from infra.local.ports import free_port
from services.trainer.settings import TrainerSettings
from services.trainer.tracking import KINDS, RunTrackers, TensorBoardTracker, resolve
from shared.contracts.run_config import RunConfig

METRICS = {1: {"reward_mean": 0.25, "pass_rate": 0.5, "loss": 1.5, "trajectories_per_s": 3.0, "staleness_0": 8.0},
           2: {"reward_mean": 0.75, "pass_rate": 1.0, "loss": 0.5, "trajectories_per_s": 4.0, "staleness_1": 8.0}}
SUMMARY = {"status": "completed", "policy_version": 2}


def _config(**tracking) -> RunConfig:
    return RunConfig(name="tracked run", model="m", dataset="d", agent={"name": "math"}, env={"name": "math"},
                     samples_per_task=2, algorithm={"lr": 3e-4}, tracking=tracking)


def _track(config: RunConfig, tmp_path: Path, kinds: dict | None = None, **settings) -> tuple[str, RunTrackers]:
    """One run's life through its trackers: start, versions 1 and 2, then its end."""
    run_id = str(uuid.uuid4())
    trackers = RunTrackers(run_id, config, resolve(config, TrainerSettings(data_dir=tmp_path, **settings)), kinds)
    trackers.start()
    for version, metrics in METRICS.items():
        trackers.log(metrics, version)
    trackers.finish(SUMMARY)
    return run_id, trackers


def _scalars(folder: Path) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(folder))
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def test_tensorboard_event_files_read_back_with_its_accumulator(tmp_path):
    run_id, trackers = _track(_config(tensorboard={"dir": str(tmp_path / "tb")}), tmp_path)
    assert trackers.errors == 0, trackers.warning
    (folder,) = (tmp_path / "tb").iterdir()
    assert folder.name == f"tracked_run-{run_id[:8]}"
    scalars = _scalars(folder)
    for name in METRICS[1]:
        assert scalars[name] == [(v, m[name]) for v, m in METRICS.items() if name in m]
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(folder))
    acc.Reload()
    text = {tag: acc.Tensors(tag)[0].tensor_proto.string_val[0].decode() for tag in acc.Tags()["tensors"]}
    assert '"lr": 0.0003' in text["config/text_summary"] and run_id in text["config/text_summary"]
    assert '"status": "completed"' in text["summary/text_summary"]


class Broken:
    """A tracker whose every write raises, as a library does on a full disk or a server gone mid-run."""

    def __init__(self, *args, **kwargs):
        pass

    def log(self, metrics, step):
        raise OSError("No space left on device")

    def finish(self, summary):
        raise OSError("No space left on device")


class NotInstalled:
    def __init__(self, *args, **kwargs):
        raise ModuleNotFoundError("No module named 'wandb'")


def test_failing_trackers_are_counted_and_warned_and_the_others_go_on(tmp_path, caplog):
    down = f"http://127.0.0.1:{free_port()}"  # nothing listens: an MLflow server that is down
    config = _config(mlflow={"tracking_uri": down}, tensorboard={"dir": str(tmp_path / "tb")}, wandb={})
    kinds = KINDS | {"wandb": NotInstalled, "broken": Broken}
    run_id = str(uuid.uuid4())
    options = resolve(config, TrainerSettings(data_dir=tmp_path)) | {"broken": {}}
    trackers = RunTrackers(run_id, config, options, kinds)
    trackers.start()  # mlflow and wandb cannot start: 2
    assert trackers.errors == 2 and set(trackers.trackers) == {"tensorboard", "broken"}
    for version, metrics in METRICS.items():
        trackers.log(metrics, version)  # broken fails each version: 2 more
    trackers.finish(SUMMARY)  # and at the end: 1 more
    assert trackers.errors == 5
    assert "No space left on device" in trackers.warning and "Training goes on" in trackers.warning
    warnings = [r.getMessage() for r in caplog.records if r.name == "services.trainer.tracking"]
    assert len(warnings) == 5 - 1  # once per tracker and call, not once per version
    assert any(down in w and "tracking server is up" in w for w in warnings)
    assert any("install wandb" in w for w in warnings)
    # TensorBoard got everything, the errors counted in its summary
    (folder,) = (tmp_path / "tb").iterdir()
    assert [s for s, _ in _scalars(folder)["reward_mean"]] == [1, 2]


def test_the_run_names_trackers_and_the_settings_fill_and_turn_them_on(tmp_path):
    settings = TrainerSettings(data_dir=tmp_path, tracking_wandb_project="team-rl", tracking_wandb_mode="offline",
                               tracking_mlflow_experiment="exp")
    assert resolve(_config(), TrainerSettings(data_dir=tmp_path)) == {}  # nothing named, nothing set: no tracker
    # TRACKING_WANDB_PROJECT turns W&B on for every run; a run's own fields win over the defaults
    assert resolve(_config(), settings) == {"wandb": {"project": "team-rl", "entity": None, "mode": "offline",
                                                      "dir": tmp_path}}
    got = resolve(_config(wandb={"project": "mine"}, mlflow={"tracking_uri": "sqlite:///x.db"}, tensorboard={}),
                  settings)
    assert got["wandb"]["project"] == "mine" and got["wandb"]["mode"] == "offline"
    assert got["mlflow"] == {"tracking_uri": "sqlite:///x.db", "experiment": "exp"}
    assert got["tensorboard"] == {"dir": tmp_path / "tensorboard"}
    assert TrainerSettings(tracking_tensorboard_dir="/tb").tracking_tensorboard_dir == Path("/tb")


@pytest.mark.parametrize("tracking, field", [
    ({"wandb": {"projet": "x"}}, "projet"), ({"wandb": {"mode": "disabled"}}, "mode"),
    ({"comet": {}}, "comet"), ({"mlflow": {"experiment": ""}}, "experiment"),
])
def test_the_tracking_config_is_strict(tracking, field):
    with pytest.raises(ValidationError, match=field):
        _config(**tracking)


def test_every_kind_is_registered_with_its_hint():
    from services.trainer.tracking import HINTS

    assert set(KINDS) == set(HINTS) == {"wandb", "mlflow", "tensorboard"}
    assert KINDS["tensorboard"] is TensorBoardTracker
