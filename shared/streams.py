"""Every Redis key and stream name the system uses, in one place. Direction is noted on each."""

ROLLOUT_TASKS = "rollout.tasks"  # controller -> rollout workers (group "rollout")
ENV_REQUESTS = "env.requests"  # rollout worker -> any env worker: first `reset` of a session (group "env")
TRAJECTORIES = "trajectories"  # rollout workers -> groups "store" (controller) and "train" (trainer)
WEIGHTS = "weights"  # weight server -> rollout workers (each reads with its own cursor, no group)
RUN_EVENTS = "run.events"  # any service -> API/dashboard (informational, trimmed)

GROUP_ROLLOUT = "rollout"
GROUP_ENV = "env"
GROUP_STORE = "store"
GROUP_TRAIN = "train"


def env_inbox(env_worker_id: str) -> str:
    """env worker's own stream: `step`/`close` of the sessions it owns (sticky sessions)."""
    return f"env.inbox.{env_worker_id}"


def env_replies(rollout_worker_id: str) -> str:
    """rollout worker's own stream: answers to its env requests."""
    return f"env.replies.{rollout_worker_id}"


def dead_letter(stream: str) -> str:
    """Where messages of `stream` go after failing N deliveries or failing to decode."""
    return f"{stream}.dlq"


def heartbeat_key(service: str, worker_id: str) -> str:
    """Expiring key a live process refreshes; its value is the process's health JSON."""
    return f"heartbeat:{service}:{worker_id}"


HEARTBEAT_PATTERN = "heartbeat:*"


def trainer_lease_key(run_id: str) -> str:
    """Expiring key naming the trainer process that owns a training run (value: its worker id)."""
    return f"trainer:lease:{run_id}"
