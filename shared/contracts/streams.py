"""Every Redis key and stream name the system uses, in one place.

The path of a trajectory is linear: rollout worker -> `trajectories` -> the store (the one place that decides
acceptance, under row locks on the ledger) -> `results.accepted` -> trainer. The trainer reports back to the
controller on `trainer.progress`; nothing crosses services through another service's tables.

| stream | producer | consumer (group) | message | acknowledged when |
|---|---|---|---|---|
| `rollout.tasks` | controller (after the ledger row commits) | rollout workers (`rollout`) | `RolloutTask` | the task's `EpisodeResult` is on `trajectories` |
| `env.requests` | rollout worker: first `reset` of a session | any env worker (`env`) | `EnvRequest` | the reply is written (the session now lives in that worker) |
| `env.inbox.<env worker>` | rollout worker: `step` / `close` of a session | that env worker (`env`) | `EnvRequest` | the reply is written |
| `env.replies.<rollout worker>` | env workers | that rollout worker (no group, own cursor) | `EnvReply` | never (read by cursor; trimmed by MAXLEN) |
| `trajectories` | rollout workers | controller's store (`store`) | `EpisodeResult` | the store transaction committed and every accepted result's `AcceptedResult` is on `results.accepted` |
| `results.accepted` | controller: completed results the store accepted (after commit) and slots out of attempts | trainer (`train`) | `AcceptedResult` | the trainer's effect is durable: the step that used it committed, or its drop / exclusion recorded in `train_samples` |
| `trainer.progress` | trainer, after each step is recorded and published / each drop is recorded (and again when it opens a run); once when it cannot load a run it leased (`error`) | controller (`controller`) | `TrainerProgress` | `runs.policy_version` and `consumed_groups` are updated; an error becomes a `trainer_error` event and fails the run with it as the reason |
| `weights` | weight server, after a checkpoint is durable | rollout workers (no group, own cursor) | `WeightsPublished` | never (read by cursor; trimmed by MAXLEN) |
| `<stream>.dlq` | `StreamConsumer` of `<stream>` | controller (`controller`) for `rollout.tasks.dlq`; people otherwise | the original entry + `dlq_*` fields | the failure is recorded in the ledger (`rollout.tasks.dlq`) |
| `run.commands` | API (`POST /v1/runs`, pause / resume / stop), jobs worker (an eval job's run) | controller (`controller`) | `RunCommand` | applied (the run created or its status changed, in one transaction with its event) or refused, and the `RunCommandReply` is on the command's reply stream |
| `run.commands.reply.<command id>` | controller | the command's sender (no group, waits with XREAD; expires after a minute) | `RunCommandReply` | never (the key expires) |
| `jobs.requests` | API (`POST /v1/datasets`, `/v1/datasets/import`, `DELETE /v1/datasets/...`, `/v1/evals`, `/v1/jobs/gc`, `/v1/runs/{id}/export`) | jobs service's intake (`jobs`) | `JobRequest` | the job's `queued` row is stored and its Celery task sent (or the request expired), and the `JobRequestReply` is on the request's answer stream |
| `jobs.requests.reply.<job id>` | jobs service | the request's sender (no group, waits with XREAD; expires after a minute) | `JobRequestReply` | never (the key expires) |
| `run.control` | controller, after a pause / resume / stop changed `runs.status` | every controller (no group, own cursor), trainer (`train`) | `RunControl` | controllers: never (read by cursor; the one driving the run applies it, ordered by `status_version`); trainer: applied to the run it trains, or acknowledged untouched by one that does not hold it (the holder reads the status at its next poll) |

Plain keys (no stream):

| key | written by | read by | what |
|---|---|---|---|
| `heartbeat:<service>:<worker id>` | every service process (shared/platform/service.py), expiring | controller, API (shared/platform/heartbeats.py) | the process's health JSON |
| `streams:epoch` | controller | controller | Redis still holds the streams (absent: its data was lost) |
| `bus:failures:<stream>:<group>` | `StreamConsumer` (hash: entry id -> handler failures) | the same | when to dead-letter |
| `tracking:<sink>:<run id>` | jobs worker (`sync_tracking`) | the same | the highest metrics.id sent to W&B / MLflow |

Celery (the jobs queue) keeps its own keys (`celery`, `_kombu.*`, `unacked*`) in the same database.
"""

ROLLOUT_TASKS = "rollout.tasks"
ENV_REQUESTS = "env.requests"
TRAJECTORIES = "trajectories"
ACCEPTED_RESULTS = "results.accepted"
TRAINER_PROGRESS = "trainer.progress"
WEIGHTS = "weights"
RUN_COMMANDS = "run.commands"
RUN_CONTROL = "run.control"
JOB_REQUESTS = "jobs.requests"

GROUP_ROLLOUT = "rollout"
GROUP_ENV = "env"
GROUP_STORE = "store"
GROUP_TRAIN = "train"
GROUP_CONTROLLER = "controller"
GROUP_JOBS = "jobs"


def env_inbox(env_worker_id: str) -> str:
    """env worker's own stream: `step`/`close` of the sessions it owns (sticky sessions)."""
    return f"env.inbox.{env_worker_id}"


def env_replies(rollout_worker_id: str) -> str:
    """rollout worker's own stream: answers to its env requests."""
    return f"env.replies.{rollout_worker_id}"


def command_reply(command_id: str) -> str:
    """Where the controller answers one `RunCommand` (a stream of one entry that expires; its sender waits on it)."""
    return f"run.commands.reply.{command_id}"


def job_reply(job_id: str) -> str:
    """Where the jobs service answers one `JobRequest` (a stream of one entry that expires; its sender waits on it)."""
    return f"jobs.requests.reply.{job_id}"


def dead_letter(stream: str) -> str:
    """Where messages of `stream` go after failing N deliveries or failing to decode."""
    return f"{stream}.dlq"


def heartbeat_key(service: str, worker_id: str) -> str:
    """Expiring key a live process refreshes; its value is the process's health JSON."""
    return f"heartbeat:{service}:{worker_id}"


def heartbeat_pattern(service: str) -> str:
    """SCAN pattern of every heartbeat key of `service`."""
    return heartbeat_key(service, "*")


def epoch_key() -> str:
    """Key the controller sets once Redis holds its streams. Its absence means Redis lost its data (or is new):
    the controller then replays from Postgres what the trainer may never have received (`results.accepted`)."""
    return "streams:epoch"


def failures_key(stream: str, group: str) -> str:
    """Hash of handler failures per entry id of `group` on `stream` (a `StreamConsumer`'s retry count)."""
    return f"bus:failures:{stream}:{group}"


def tracking_cursor_key(sink: str, run_id: str) -> str:
    """The highest metrics.id of run `run_id` the tracking job sent to `sink` (wandb, mlflow)."""
    return f"tracking:{sink}:{run_id}"
