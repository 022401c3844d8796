"""W&B and MLflow trackers against the real libraries, offline: W&B's offline run file (written by its own service
process) read back with W&B's own reader (`wandb leet inspect`), MLflow's SQLite store read back through
MlflowClient."""

from __future__ import annotations

import json
import subprocess
import sys
import uuid
from pathlib import Path

from services.trainer.settings import TrainerSettings
from services.trainer.tracking import RunTrackers, resolve
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


def test_wandb_offline_run_file_holds_config_every_version_and_summary(tmp_path):
    run_id, trackers = _track(_config(wandb={"project": "flywheel-test", "mode": "offline"}), tmp_path)
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
    run_id, trackers = _track(_config(mlflow={"tracking_uri": uri, "experiment": "rl"}), tmp_path)
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
    trackers = RunTrackers(run_id, _config(), {"mlflow": {"tracking_uri": uri, "experiment": "rl"}})
    trackers.start()
    trackers.log({"reward_mean": 1.0}, 3)
    trackers.finish(None)
    assert trackers.errors == 0, trackers.warning
    (again,) = client.search_runs([run.info.experiment_id], f"tags.`flywheel.run_id` = '{run_id}'")
    assert again.info.run_id == run.info.run_id and again.data.metrics["reward_mean"] == 1.0
