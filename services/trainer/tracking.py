"""Experiment trackers of training runs: W&B, MLflow, TensorBoard, any combination (the run's `tracking`, with
the trainer's TRACKING_* settings as server-wide defaults). Each gets the run's config at start, every policy
version's metrics with the version as the step, and a summary when the run ends; a run opened again is re-sent
the versions a tracker missed. A library is imported only when a run uses it. A tracker never fails or blocks a
run: each has a thread of its own, and any error (not installed, server down, bad credentials, a write that
raises) or a call that hangs is logged, counted (metric `tracker_errors`) and kept as the run's tracker warning
(the trainer's heartbeat); one that cannot start is left out until the run is opened again.
"""

from __future__ import annotations

import json
import os
import queue
import re
import threading
import time
from pathlib import Path

from shared.contracts.run_config import RunConfig
from shared.platform.logs import get_logger
from shared.platform.settings import mask_url

log = get_logger(__name__)

# MLflow's HTTP client retries 7 times with backoff and a 120 s timeout by default: minutes per call against a
# server that is down, while every other run's tracking waits on the same thread. Fewer, shorter tries instead
# (an operator's own MLFLOW_HTTP_* settings win).
MLFLOW_HTTP_DEFAULTS = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "2", "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1",
                        "MLFLOW_HTTP_REQUEST_TIMEOUT": "10"}
MLFLOW_PARAM_MAX = 6000  # MLflow rejects longer param values
MLFLOW_STATUS = {"completed": "FINISHED", "failed": "FAILED"}  # any other end (stopped): KILLED


class WandbTracker:
    def __init__(self, run_id: str, name: str, config: dict, *, project: str | None, entity: str | None,
                 mode: str | None, dir: Path):
        import wandb

        dir.mkdir(parents=True, exist_ok=True)
        # id = the run's id: a trainer that opens the run again (restart, failover) resumes the same W&B run.
        # No console capture or system stats: one process trains many runs.
        self.run = wandb.init(project=project, entity=entity, mode=mode, dir=str(dir), id=run_id, name=name,
                              config=config, resume="allow", reinit="create_new",
                              settings=wandb.Settings(console="off", x_disable_stats=True, silent=True))

    def log(self, metrics: dict[str, float], step: int) -> None:
        self.run.log(metrics, step=step)

    def finish(self, summary: dict | None) -> None:
        if summary is not None:
            self.run.summary.update(summary)
        self.run.finish(exit_code=1 if summary and summary["status"] == "failed" else 0)


class MlflowTracker:
    def __init__(self, run_id: str, name: str, config: dict, *, tracking_uri: str | None, experiment: str):
        for k, v in MLFLOW_HTTP_DEFAULTS.items():
            os.environ.setdefault(k, v)
        from mlflow.entities import Param
        from mlflow.tracking import MlflowClient

        # The client, not mlflow's fluent API: that keeps one active run per process, this trainer has many.
        self.client = client = MlflowClient(tracking_uri)
        found = client.get_experiment_by_name(experiment)
        exp = found.experiment_id if found else client.create_experiment(experiment)
        runs = client.search_runs([exp], f"tags.`flywheel.run_id` = '{run_id}'", max_results=1)
        if runs:  # opened again (trainer restart, failover): the same MLflow run, its params already logged
            self.id = runs[0].info.run_id
            client.update_run(self.id, status="RUNNING")
            return
        self.id = client.create_run(exp, run_name=name, tags={"flywheel.run_id": run_id}).info.run_id
        params = [Param(k, str(v)[:MLFLOW_PARAM_MAX]) for k, v in flatten(config).items()]
        for i in range(0, len(params), 100):  # MLflow's limit per batch
            client.log_batch(self.id, params=params[i:i + 100])

    def log(self, metrics: dict[str, float], step: int) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        rows = [Metric(k, float(v), now, step) for k, v in metrics.items()]
        for i in range(0, len(rows), 1000):
            self.client.log_batch(self.id, metrics=rows[i:i + 1000])

    def finish(self, summary: dict | None) -> None:
        if summary is None:  # the trainer let the run go (shutdown, lease moved): it stays RUNNING for the next
            return
        from mlflow.entities import RunTag

        self.client.log_batch(self.id, tags=[RunTag(f"summary.{k}", str(v)) for k, v in summary.items()])
        self.client.set_terminated(self.id, MLFLOW_STATUS.get(summary["status"], "KILLED"))


class TensorBoardTracker:
    def __init__(self, run_id: str, name: str, config: dict, *, dir: Path):
        from torch.utils.tensorboard import SummaryWriter

        # One folder per run, named for people (TensorBoard lists runs by folder); a reopened run appends a new
        # event file to the same folder, which TensorBoard reads as one run.
        self.dir = Path(dir) / f"{re.sub(r'[^A-Za-z0-9_.-]+', '_', name)}-{run_id[:8]}"
        self.writer = SummaryWriter(log_dir=str(self.dir))
        self.writer.add_text("config", _markdown_json(config), 0)
        self.writer.flush()

    def log(self, metrics: dict[str, float], step: int) -> None:
        for k, v in metrics.items():
            self.writer.add_scalar(k, v, step)
        self.writer.flush()  # visible in TensorBoard now, not at the writer's next timed flush

    def finish(self, summary: dict | None) -> None:
        if summary is not None:
            self.writer.add_text("summary", _markdown_json(summary), summary["policy_version"])
        self.writer.close()


KINDS = {"wandb": WandbTracker, "mlflow": MlflowTracker, "tensorboard": TensorBoardTracker}
HINTS = {
    "wandb": "check WANDB_API_KEY (or `wandb login`) on the trainer and the project/entity, or use mode offline",
    "mlflow": "check that the tracking server is up and reachable from the trainer (MLFLOW_TRACKING_USERNAME / "
              "MLFLOW_TRACKING_PASSWORD when it needs a login)",
    "tensorboard": "check that the folder is writable by the trainer",
}


def resolve(config: RunConfig, settings) -> dict[str, dict]:
    """Tracker kind -> its options, for each tracker the run names or the trainer's settings turn on for every
    run; the run's fields win, the settings fill what it leaves unset, the libraries' own defaults the rest."""
    t, s, out = config.tracking, settings, {}
    if t.wandb is not None or s.tracking_wandb_project:
        w = t.wandb
        out["wandb"] = {"project": (w and w.project) or s.tracking_wandb_project,
                        "entity": (w and w.entity) or s.tracking_wandb_entity,
                        "mode": (w and w.mode) or s.tracking_wandb_mode, "dir": Path(s.data_dir)}
    if t.mlflow is not None or s.tracking_mlflow_tracking_uri:
        m = t.mlflow
        out["mlflow"] = {"tracking_uri": (m and m.tracking_uri) or s.tracking_mlflow_tracking_uri,
                         "experiment": (m and m.experiment) or s.tracking_mlflow_experiment or "flywheel"}
    if t.tensorboard is not None or s.tracking_tensorboard_dir:
        d = (t.tensorboard and t.tensorboard.dir) or s.tracking_tensorboard_dir or Path(s.data_dir) / "tensorboard"
        out["tensorboard"] = {"dir": Path(d)}
    return out


class RunTrackers:
    """The trackers of one run. Each tracker is fed by a daemon thread of its own, in call order (start, each
    version, finish), so a slow or hung tracker holds back only itself: its versions wait in order and go out
    when it answers; while a call has not returned for `hung_after_s` the run's tracker warning says so. Every
    call is caught, logged and counted. `logged` (kind -> newest version it holds, from `tracker_progress`) skips
    what a tracker already has, so re-sending a run's committed versions after a crash loses none and repeats
    none, unless the trainer died between a tracker's write and `on_logged(kind, version)` recording it."""

    def __init__(self, run_id: str, config: RunConfig, options: dict[str, dict], kinds: dict | None = None, *,
                 logged: dict[str, int] | None = None, on_logged=None, hung_after_s: float = 60.0):
        self.run_id, self.name, self.options = run_id, config.name, options
        self.config = {"run_id": run_id, **config.model_dump(mode="json")}
        self.kinds = kinds or KINDS
        self.logged = {kind: (logged or {}).get(kind, 0) for kind in options}
        self.on_logged, self.hung_after_s = on_logged, hung_after_s
        self.trackers: dict[str, object] = {}
        self.errors = 0  # every failed call, since this trainer opened the run
        self.failure: str | None = None  # the latest failure
        self._warned: set[tuple[str, str]] = set()
        self._queues = {kind: queue.Queue() for kind in options}
        self._finished = 0  # 1 once finish() queued the end of calls
        self._busy: dict[str, tuple[float, str, int]] = {}  # kind -> (monotonic start, call, version) in progress
        self._threads = [threading.Thread(target=self._serve, args=(kind,), daemon=True,  # a hung call never
                                          name=f"tracker-{kind}-{run_id[:8]}") for kind in options]  # holds exit
        for t in self._threads:
            t.start()

    @property
    def warning(self) -> str | None:
        """The run's tracker warning (the trainer's heartbeat): a call in progress too long, else the latest
        failure."""
        now = time.monotonic()
        for kind, (since, call, version) in list(self._busy.items()):
            if now - since > self.hung_after_s:
                waiting = self._queues[kind].qsize() - self._finished  # less the end-of-calls marker
                return (f"tracker {kind}{self._where(kind)}: its {call} call (policy version {version}) has not "
                        f"returned in {now - since:.0f}s; {waiting} calls wait for it; "
                        f"{HINTS.get(kind, 'see the trainer log')}. Training goes on")
        return self.failure

    def start(self) -> None:
        self._put(("start", None, 0))

    def log(self, metrics: dict[str, float], step: int) -> None:
        self._put(("log", metrics, step))

    def finish(self, summary: dict | None) -> None:
        """`summary` when the run ended (status, policy version, tracker errors, last metrics); None when the
        trainer only lets the run go (another trainer, or this one after a restart, goes on logging it). No call
        is taken after it."""
        self._put(("finish", summary, 0))
        self._finished = 1
        for q in self._queues.values():
            q.put(None)

    def join(self, timeout_s: float) -> bool:
        """Wait up to `timeout_s` in all for the trackers' calls so far; False if some are still in progress."""
        deadline = time.monotonic() + timeout_s
        for t in self._threads:
            t.join(max(deadline - time.monotonic(), 0))
        return not any(t.is_alive() for t in self._threads)

    def _put(self, call: tuple) -> None:
        for q in self._queues.values():
            q.put(call)

    def _serve(self, kind: str) -> None:
        while (call := self._queues[kind].get()) is not None:
            name, arg, version = call
            self._busy[kind] = (time.monotonic(), name, version)
            try:
                self._call(kind, name, arg, version)
            finally:
                del self._busy[kind]

    def _call(self, kind: str, name: str, arg, version: int) -> None:
        if name == "start":
            try:
                self.trackers[kind] = self.kinds[kind](self.run_id, self.name, self.config, **self.options[kind])
            except Exception as e:  # whatever the library raises, the run trains on
                self._failed(kind, "start", "could not start, left out of this run", e)
            return
        tracker = self.trackers.get(kind)
        if tracker is None:  # it could not start
            return
        if name == "log":
            if version <= self.logged[kind]:  # re-sent after a crash, and this tracker has it
                return
            try:
                tracker.log(arg, version)
            except Exception as e:
                self._failed(kind, "log", f"policy version {version} not logged", e)
                return
            self.logged[kind] = version
            if self.on_logged is not None:
                try:
                    self.on_logged(kind, version)
                except Exception as e:  # a restart then re-sends this version: logged twice, never lost
                    self._failed(kind, "progress", f"could not record that it holds version {version}", e)
            return
        summary = None if arg is None else {**arg, "tracker_errors": self.errors}
        try:
            tracker.finish(summary)
        except Exception as e:
            self._failed(kind, "finish", "could not finish", e)

    def _where(self, kind: str) -> str:
        opts = self.options.get(kind, {})  # which server, project or folder: what to check first
        where = opts.get("tracking_uri") or opts.get("project") or opts.get("dir") or ""
        return f" ({mask_url(str(where))})" if where else ""

    def _failed(self, kind: str, call: str, what: str, e: Exception) -> None:
        self.errors += 1
        hint = (f"install {kind} in the trainer's environment" if isinstance(e, ImportError)
                else HINTS.get(kind, "see the trainer's log"))
        self.failure = f"tracker {kind}{self._where(kind)}: {what}: {type(e).__name__}: {str(e)[:300]}; {hint}. " \
                       "Training goes on"
        if (kind, call) not in self._warned:  # once per tracker and call: no log line per version
            self._warned.add((kind, call))
            log.warning("%s", self.failure, extra={"run_id": self.run_id})


def flatten(d: dict, prefix: str = "") -> dict[str, object]:
    """{"algorithm": {"lr": 1e-6}} -> {"algorithm.lr": 1e-6}; lists as JSON."""
    out: dict[str, object] = {}
    for k, v in d.items():
        if isinstance(v, dict) and v:
            out |= flatten(v, f"{prefix}{k}.")
        else:
            out[f"{prefix}{k}"] = json.dumps(v) if isinstance(v, list | dict) else v
    return out


def _markdown_json(d: dict) -> str:
    # TensorBoard renders text as markdown: a code block keeps the JSON's indentation
    return "```\n" + json.dumps(d, indent=2, default=str) + "\n```"
