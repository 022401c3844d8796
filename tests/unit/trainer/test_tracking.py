"""Experiment trackers offline: TensorBoard's event files read back through its EventAccumulator; the tracking
config. W&B and MLflow, whose libraries start processes and open sockets, and trackers that fail (a server down,
not installed, a write that raises): tests/component/test_tracking_stores.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError

from services.trainer.settings import TrainerSettings
from services.trainer.tracking import KINDS, TensorBoardTracker, resolve
from tests.support.trackers import METRICS, tensorboard_scalars, track, tracked_config


def test_tensorboard_event_files_read_back_with_its_accumulator(tmp_path):
    run_id, trackers = track(tracked_config(tensorboard={"dir": str(tmp_path / "tb")}), tmp_path)
    assert trackers.errors == 0, trackers.warning
    (folder,) = (tmp_path / "tb").iterdir()
    assert folder.name == f"tracked_run-{run_id[:8]}"
    scalars = tensorboard_scalars(folder)
    for name in METRICS[1]:
        assert scalars[name] == [(v, m[name]) for v, m in METRICS.items() if name in m]
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(folder))
    acc.Reload()
    text = {tag: acc.Tensors(tag)[0].tensor_proto.string_val[0].decode() for tag in acc.Tags()["tensors"]}
    assert '"lr": 0.0003' in text["config/text_summary"] and run_id in text["config/text_summary"]
    assert '"status": "completed"' in text["summary/text_summary"]


def test_the_run_names_trackers_and_the_settings_fill_and_turn_them_on(tmp_path):
    settings = TrainerSettings(data_dir=tmp_path, tracking_wandb_project="team-rl", tracking_wandb_mode="offline",
                               tracking_mlflow_experiment="exp")
    assert resolve(tracked_config(), TrainerSettings(data_dir=tmp_path)) == {}  # nothing named, nothing set: no tracker
    # TRACKING_WANDB_PROJECT turns W&B on for every run; a run's own fields win over the defaults
    assert resolve(tracked_config(), settings) == {"wandb": {"project": "team-rl", "entity": None, "mode": "offline",
                                                      "dir": tmp_path}}
    got = resolve(tracked_config(wandb={"project": "mine"}, mlflow={"tracking_uri": "sqlite:///x.db"}, tensorboard={}),
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
        tracked_config(**tracking)


def test_every_kind_is_registered_with_its_hint():
    from services.trainer.tracking import HINTS

    assert set(KINDS) == set(HINTS) == {"wandb", "mlflow", "tensorboard"}
    assert KINDS["tensorboard"] is TensorBoardTracker
