"""W&B and MLflow trackers against the real libraries, offline: W&B's offline run file (written by its own service
process) read back with W&B's own reader (`wandb leet inspect`), MLflow's SQLite store read back through
MlflowClient; trackers that fail (MLflow's server down, W&B not installed, a write that raises) are counted and
warned about, and the others go on."""

from __future__ import annotations

import json
import subprocess
import sys
import uuid
from pathlib import Path

from infra.local.ports import free_port
from services.trainer.settings import TrainerSettings
from services.trainer.tracking import KINDS, RunTrackers, resolve
from tests.support.trackers import METRICS, SUMMARY, tensorboard_scalars, track, tracked_config


def test_wandb_offline_run_file_holds_config_every_version_and_summary(tmp_path):
    run_id, trackers = track(tracked_config(wandb={"project": "flywheel-test", "mode": "offline"}), tmp_path)
    assert trackers.errors == 0, trackers.warning
    (path,) = (tmp_path / "wandb").glob(f"offline-run-*-{run_id}/run-{run_id}.wandb")  # under DATA_DIR
    wandb = Path(sys.executable).with_name("wandb")
    records = [json.loads(line) for line in subprocess.run(
        [wandb, "leet", "inspect", "--json", str(path)], check=True, capture_output=True, text=True,
        timeout=120).stdout.splitlines()]
    history = {r["history"]["step"]["num"]: r["history"]["item"] for r in records if r["type"] == "history"}
    assert sorted(history) == [1, 2]  # the policy version is the step
    for version, metrics in METRICS.items():
        assert {k: history[version][k] for k in metrics} == metrics
    run = json.loads(subprocess.run([wandb, "leet", "inspect", "--summary", "--json", str(path)], check=True,
                                    capture_output=True, text=True, timeout=120).stdout)
    assert (run["run_id"], run["name"], run["project"], run["state"]) == (run_id, "tracked run", "flywheel-test",
                                                                         "finished")
    assert run["config"]["run_id"] == run_id and run["config"]["algorithm"]["lr"] == 3e-4
    assert run["summary"]["status"] == "completed" and run["summary"]["policy_version"] == 2
    assert run["summary"]["tracker_errors"] == 0 and run["summary"]["reward_mean"] == 0.75


def test_mlflow_sqlite_store_read_back_through_its_client(tmp_path):
    from mlflow.tracking import MlflowClient

    uri = f"sqlite:///{tmp_path}/mlflow.db"
    run_id, trackers = track(tracked_config(mlflow={"tracking_uri": uri, "experiment": "rl"}), tmp_path)
    assert trackers.errors == 0, trackers.warning
    client = MlflowClient(uri)
    (run,) = client.search_runs([client.get_experiment_by_name("rl").experiment_id],
                                f"tags.`flywheel.run_id` = '{run_id}'")
    assert run.info.run_name == "tracked run" and run.info.status == "FINISHED"
    for name in METRICS[1]:
        got = {m.step: m.value for m in client.get_metric_history(run.info.run_id, name)}
        assert got == {v: m[name] for v, m in METRICS.items() if name in m}, name
    assert float(run.data.params["algorithm.lr"]) == 3e-4 and run.data.params["run_id"] == run_id
    assert run.data.tags["summary.status"] == "completed" and run.data.tags["summary.policy_version"] == "2"

    # Opened again (a trainer restart): the same MLflow run goes on, its params untouched.
    trackers = RunTrackers(run_id, tracked_config(), {"mlflow": {"tracking_uri": uri, "experiment": "rl"}})
    trackers.start()
    trackers.log({"reward_mean": 1.0}, 3)
    trackers.finish(None)
    assert trackers.join(120) and trackers.errors == 0, trackers.warning
    (again,) = client.search_runs([run.info.experiment_id], f"tags.`flywheel.run_id` = '{run_id}'")
    assert again.info.run_id == run.info.run_id and again.data.metrics["reward_mean"] == 1.0


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
    config = tracked_config(mlflow={"tracking_uri": down}, tensorboard={"dir": str(tmp_path / "tb")}, wandb={})
    kinds = KINDS | {"wandb": NotInstalled, "broken": Broken}
    run_id = str(uuid.uuid4())
    options = resolve(config, TrainerSettings(data_dir=tmp_path)) | {"broken": {}}
    trackers = RunTrackers(run_id, config, options, kinds)
    trackers.start()  # mlflow and wandb cannot start: 2
    for version, metrics in METRICS.items():
        trackers.log(metrics, version)  # broken fails each version: 2 more
    trackers.finish(SUMMARY)  # and at the end: 1 more
    assert trackers.join(120)
    assert trackers.errors == 5 and set(trackers.trackers) == {"tensorboard", "broken"}
    assert "Training goes on" in trackers.warning  # the latest failure, whichever tracker's thread that was
    warnings = [r.getMessage() for r in caplog.records if r.name == "services.trainer.tracking"]
    assert len(warnings) == 5 - 1  # once per tracker and call, not once per version
    assert any("No space left on device" in w for w in warnings)
    assert any(down in w and "tracking server is up" in w for w in warnings)
    assert any("install wandb" in w for w in warnings)
    # TensorBoard got everything, the errors counted in its summary
    (folder,) = (tmp_path / "tb").iterdir()
    assert [s for s, _ in tensorboard_scalars(folder)["reward_mean"]] == [1, 2]
