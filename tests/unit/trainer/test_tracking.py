"""Experiment trackers offline: TensorBoard's event files read back through its EventAccumulator; the tracking
config. W&B and MLflow, whose libraries start processes and open sockets, and trackers that fail (a server down,
not installed, a write that raises): tests/component/test_tracking_stores.py.
"""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
from pydantic import ValidationError

from services.trainer.settings import TrainerSettings
from services.trainer.tracking import KINDS, RunTrackers, TensorBoardTracker, resolve
from tests.support.trackers import METRICS, SUMMARY, tensorboard_scalars, track, tracked_config


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


class Recorder:
    """A tracker that keeps what it was given; `gate`, when set, holds every log call until it opens."""

    gate: threading.Event | None = None

    def __init__(self, run_id, name, config, **opts):
        self.calls: list = []

    def log(self, metrics, step):
        if self.gate is not None:
            self.gate.wait(30)
        self.calls.append(step)

    def finish(self, summary):
        self.calls.append(("finish", summary["status"] if summary else None))


class Hanging(Recorder):
    gate = threading.Event()


def test_a_hung_tracker_holds_back_only_itself_and_its_versions_go_out_in_order_when_it_answers():
    trackers = RunTrackers("r" * 8, tracked_config(), {"fast": {}, "slow": {}}, {"fast": Recorder, "slow": Hanging},
                           hung_after_s=0.2)
    trackers.start()
    for version in (1, 2, 3):
        trackers.log({"reward_mean": 0.5}, version)
    trackers.finish(SUMMARY)
    assert not trackers.join(1.0)  # the slow one is stuck in version 1
    assert trackers.trackers["fast"].calls == [1, 2, 3, ("finish", "completed")]
    assert trackers.trackers["slow"].calls == []
    warning = trackers.warning
    assert "tracker slow" in warning and "(policy version 1) has not returned" in warning
    assert "3 calls wait for it" in warning and "Training goes on" in warning
    Hanging.gate.set()
    assert trackers.join(10)
    assert trackers.trackers["slow"].calls == [1, 2, 3, ("finish", "completed")]
    assert trackers.warning is None and trackers.errors == 0


def test_versions_a_tracker_holds_are_not_sent_again_and_each_new_one_is_recorded():
    recorded = []
    trackers = RunTrackers("r" * 8, tracked_config(), {"a": {}, "b": {}}, {"a": Recorder, "b": Recorder},
                           logged={"a": 2}, on_logged=lambda kind, v: recorded.append((kind, v)))
    trackers.start()
    for version in (1, 2, 3):  # a trainer re-sending every committed version after a crash
        trackers.log({"loss": 1.0}, version)
    trackers.finish(None)
    assert trackers.join(10)
    assert trackers.trackers["a"].calls == [3, ("finish", None)]  # it held 1 and 2
    assert trackers.trackers["b"].calls == [1, 2, 3, ("finish", None)]
    assert sorted(recorded) == [("a", 3), ("b", 1), ("b", 2), ("b", 3)]
