"""Every Redis key and stream name the system uses, in one place, and the tables that say who writes and reads
each (STREAM_TABLE, KEY_TABLE): the one source of the streams table in docs/architecture.md, which
`python -m shared.contracts.streams` prints and a test compares.

The path of a trajectory is linear: rollout worker -> `trajectories` -> the store (the one place that decides
acceptance, under row locks on the ledger) -> `results.accepted` -> trainer. The trainer reports back to the
controller on `trainer.progress`; nothing crosses services through another service's tables.
"""

from __future__ import annotations

from typing import NamedTuple

ROLLOUT_TASKS = "rollout.tasks"
ENV_REQUESTS = "env.requests"
TRAJECTORIES = "trajectories"
ACCEPTED_RESULTS = "results.accepted"
TRAINER_PROGRESS = "trainer.progress"
WEIGHTS = "weights"
RUN_COMMANDS = "run.commands"
RUN_CONTROL = "run.control"
JOB_REQUESTS = "jobs.requests"
TINKER_REQUESTS = "tinker.requests"
TINKER_SAMPLES = "tinker.samples"

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


def tinker_model_ops(model_id: str) -> str:
    """A Tinker training model's operations (`TinkerOp`) in the order sent, read (group `train`) by the one trainer
    holding the model's run lease; `tinker.requests` tells the fleet that such a stream has work."""
    return f"tinker.ops.{model_id}"


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
    the controller then replays from Postgres what the trainer may never have received (`results.accepted`),
    the key saying `replaying:<token>` until a replay finished with nothing wiping Redis meanwhile."""
    return "streams:epoch"


def failures_key(stream: str, group: str) -> str:
    """Hash of handler failures per entry id of `group` on `stream` (a `StreamConsumer`'s retry count)."""
    return f"bus:failures:{stream}:{group}"


def tracking_cursor_key(sink: str, run_id: str) -> str:
    """The highest metrics.id of run `run_id` the tracking job sent to `sink` (wandb, mlflow)."""
    return f"tracking:{sink}:{run_id}"


def tinker_key(kind: str, id: str) -> str:
    """One record of the Tinker protocol (kind: session, model, future) as JSON with its owner, expiring."""
    return f"tinker:{kind}:{id}"


class StreamRow(NamedTuple):
    stream: str
    pattern: str  # the shared.platform.bus pattern it travels by
    producer: str
    consumer: str  # (group) or how it is read
    message: str
    acknowledged: str


STREAM_TABLE: tuple[StreamRow, ...] = (
    StreamRow('rollout.tasks', 'work queue',
              'controller (after the ledger row commits)',
              'rollout workers (`rollout`)',
              '`RolloutTask`',
              "the task's `EpisodeResult` is on `trajectories`"),
    StreamRow('env.requests', 'request/reply',
              'rollout worker: first `reset` of a session',
              'any env worker (`env`)',
              '`EnvRequest`',
              'the reply is written (the session now lives in that worker)'),
    StreamRow('env.inbox.<env worker>', 'request/reply',
              'rollout worker: `step` / `close` of a session',
              'that env worker (`env`)',
              '`EnvRequest`',
              'the reply is written'),
    StreamRow('env.replies.<rollout worker>', 'request/reply',
              'env workers',
              'that rollout worker (no group, own cursor)',
              '`EnvReply`',
              'never (read by cursor; trimmed by MAXLEN)'),
    StreamRow('trajectories', 'work queue',
              'rollout workers',
              "controller's store (`store`)",
              '`EpisodeResult`',
              "the store transaction committed and every accepted result's `AcceptedResult` is on `results.accepted`"),
    StreamRow('results.accepted', 'work queue',
              'controller: completed results the store accepted (after commit) and slots out of attempts',
              'trainer (`train`)',
              '`AcceptedResult`',
              "the trainer's effect is durable: the step that used it committed, or its drop / exclusion recorded in `train_samples`"),
    StreamRow('trainer.progress', 'work queue',
              'trainer, after each step is recorded and published / each drop is recorded (and again when it opens a run); once when it cannot load a run it leased (`error`)',
              'controller (`controller`)',
              '`TrainerProgress`',
              '`runs.policy_version` and `consumed_groups` are updated; an error becomes a `trainer_error` event and fails the run with it as the reason'),
    StreamRow('weights', 'broadcast',
              'weight server, after a checkpoint is durable',
              'rollout workers (no group, own cursor)',
              '`WeightsPublished`',
              'never (read by cursor; trimmed by MAXLEN)'),
    StreamRow('<stream>.dlq', 'work queue',
              '`StreamConsumer` of `<stream>`',
              'controller (`controller`) for `rollout.tasks.dlq`; people otherwise',
              'the original entry + `dlq_*` fields',
              'the failure is recorded in the ledger (`rollout.tasks.dlq`)'),
    StreamRow('run.commands', 'command',
              "API (`POST /v1/runs`, pause / resume / stop), jobs worker (an eval job's run)",
              'controller (`controller`)',
              '`RunCommand`',
              "applied (the run created or its status changed, in one transaction with its event) or refused, and the `RunCommandReply` is on the command's reply stream"),
    StreamRow('run.commands.reply.<command id>', 'command',
              'controller',
              "the command's sender (no group, waits with XREAD; expires after a minute)",
              '`RunCommandReply`',
              'never (the key expires)'),
    StreamRow('jobs.requests', 'command',
              'API (`POST /v1/datasets`, `/v1/datasets/import`, `DELETE /v1/datasets/...`, `/v1/evals`, `/v1/jobs/gc`, `/v1/runs/{id}/export`)',
              "jobs service's intake (`jobs`)",
              '`JobRequest`',
              "the job's `queued` row is stored and its Celery task sent (or the request expired), and the `JobRequestReply` is on the request's answer stream"),
    StreamRow('jobs.requests.reply.<job id>', 'command',
              'jobs service',
              "the request's sender (no group, waits with XREAD; expires after a minute)",
              '`JobRequestReply`',
              'never (the key expires)'),
    StreamRow('run.control', 'broadcast (controllers), work queue (trainer)',
              'controller, after a pause / resume / stop changed `runs.status`',
              'every controller (no group, own cursor), trainer (`train`)',
              '`RunControl`',
              'controllers: never (read by cursor; the one driving the run applies it, ordered by `status_version`); trainer: applied to the run it trains, or acknowledged untouched by one that does not hold it (the holder reads the status at its next poll)'),
    StreamRow('tinker.requests', 'work queue',
              "API, after each operation it put on a model's `tinker.ops.<model id>`",
              'trainer (`train`)',
              '`TinkerWake`',
              "the trainer reading it holds the model (it took the free lease, or had it) or another live trainer does; a model whose holder died is taken over by the next trainer to find its lease expired with operations waiting"),
    StreamRow('tinker.ops.<model id>', 'work queue',
              'API: `forward_backward`, `forward`, `optim_step`, `save_*`, `load_*` of a Tinker training client, once its future is stored (expires a week after its last operation)',
              'the trainer holding the model\'s run lease (`train`); a new holder takes over what the last one left pending',
              '`TinkerOp`',
              "the operation's result (or error) is in its future `tinker:future:<request id>`"),
    StreamRow('tinker.samples', 'work queue',
              'API: `asample` of a Tinker sampling session, once its future is stored',
              'rollout workers (`rollout`)',
              '`TinkerSample`',
              "its samples are on `trajectories` (stored as the session run's episodes) and the answer is in its future"),
)


class KeyRow(NamedTuple):
    key: str
    written_by: str
    read_by: str
    what: str


KEY_TABLE: tuple[KeyRow, ...] = (
    KeyRow('heartbeat:<service>:<worker id>', 'every service process (shared/platform/service.py), expiring', 'controller, API (shared/platform/heartbeats.py)', "the process's health JSON"),
    KeyRow('streams:epoch', 'controller', 'controller', 'Redis still holds the streams (absent: its data was lost)'),
    KeyRow('bus:failures:<stream>:<group>', '`StreamConsumer` (hash: entry id -> handler failures)', 'the same', 'when to dead-letter'),
    KeyRow('tinker:<kind>:<id>', 'API (the Tinker protocol: sessions and their indexes `owner_sessions`, `session_runs`, `session_models`, `session_samplers`, LoRA models, samplers, futures, `published` checkpoints, `copy` (a copy_weights idempotency key -> the copy); docs/tinker.md); trainer: the results of the futures of `tinker.ops.<model id>`, `checkpoint`, `model_state` and `model_seq` (the last seq_id it applied to a model); rollout workers: the results of `tinker.samples`', 'API (and a `checkpoint`\'s `expires_at`: delete, ttl); trainer (`checkpoint`, `model_state`, `model_seq`)', 'the record as JSON with the sha256 of the key that made it; expires (futures after a day, models a week after creation, sessions a week after their last heartbeat; a checkpoint past its `expires_at` is removed, files and record, by the trainer)'),
    KeyRow('tracking:<sink>:<run id>', 'jobs worker (`sync_tracking`)', 'the same', 'the highest metrics.id sent to W&B / MLflow'),
)
OTHER_KEYS = "Celery (the jobs queue) keeps its own keys (`celery`, `_kombu.*`, `unacked*`) in the same database."


def markdown() -> str:
    """The streams table and the keys table as Markdown (docs/architecture.md holds this text)."""
    streams = ["| stream | pattern | producer | consumer (group) | message | acknowledged when |",
               "|---|---|---|---|---|---|"]
    streams += [f"| `{r.stream}` | {r.pattern} | {r.producer} | {r.consumer} | {r.message} | {r.acknowledged} |"
                for r in STREAM_TABLE]
    keys = ["| key | written by | read by | what |", "|---|---|---|---|"]
    keys += [f"| `{r.key}` | {r.written_by} | {r.read_by} | {r.what} |" for r in KEY_TABLE]
    return "\n".join([*streams, "", "Plain keys (no stream):", "", *keys, "", OTHER_KEYS]) + "\n"


if __name__ == "__main__":
    print(markdown(), end="")
