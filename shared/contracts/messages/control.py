"""Run control as messages. Two streams:

- `run.commands` (API, eval jobs -> controller): `RunCommand`, applied in one transaction, idempotent by
  `command_id`, answered with a `RunCommandReply`; one read too late is answered `expired` and not applied.
- `run.control` (controller -> controller and trainer): `RunControl`, published once a pause, resume or stop
  has been applied; whoever drives or trains the run applies it at once, the others acknowledge it untouched
  and read the status at their next poll.

More: docs/architecture.md#run-commands-and-run-control
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from shared.contracts.messages.codec import Message

Action = Literal["pause", "resume", "stop"]
CommandAction = Literal["create", "pause", "resume", "stop", "complete", "fail"]
Outcome = Literal["applied", "refused", "not_found", "expired"]

# action -> (statuses it is allowed from, status it sets)
TRANSITIONS: dict[str, tuple[tuple[str, ...], str]] = {
    "pause": (("running",), "paused"),
    "resume": (("paused",), "running"),
    "stop": (("pending", "running", "paused"), "stopping"),
}
# A tinker run ends as its Tinker client ends its session (stop: interrupted; complete: success; fail: errored).
# Nothing of it is driven or drained but by that client, so the status is set at once and `run.control` is not
# told; other runs complete or fail by themselves and refuse these.
TINKER_ENDS: dict[str, str] = {"stop": "stopped", "complete": "completed", "fail": "failed"}
MAX_REASON_CHARS = 2000


class RunCommand(Message):
    TYPE = "run_command"
    SCHEMA_VERSION = 1

    command_id: str
    run_id: str  # create: the id the new run gets (chosen by the sender, so a redelivery cannot make two)
    action: CommandAction
    config: dict[str, Any] | None = None  # create: the checked RunConfig, its dataset version pinned
    rows: int | None = None  # create: the dataset's row count when it was checked
    created_by: str | None = None  # create: who asked ("job <id>"), for the `created` event
    reason: str | None = Field(None, max_length=MAX_REASON_CHARS)  # fail: why, stored as the run's error
    sent_at: float  # unix seconds, the sender's clock
    expires_at: float  # unix seconds: not applied when read later (the sender gave up at this time)


class RunCommandReply(Message):
    TYPE = "run_command_reply"
    SCHEMA_VERSION = 1

    command_id: str
    outcome: Outcome  # applied; refused (the run's status allows no such action); not_found; expired
    status: str | None = None  # the run's status after the command (None: no such run)
    message: str = ""
    status_version: int | None = None  # runs.status_version after the change it applied (None: none applied)


class RunControl(Message):
    TYPE = "run_control"
    SCHEMA_VERSION = 1

    run_id: str
    action: Action
    sent_at: float = 0.0  # unix seconds, the controller's clock once the change committed (for people only)
    status_version: int = Field(0, ge=0, description="runs.status_version the change committed: receivers order "
                                "control by it against their own read of the runs table, never by clocks")

    @property
    def status(self) -> str:
        """The status the action sets."""
        return TRANSITIONS[self.action][1]

    def applies_to(self, status: str) -> bool:
        """Whether a run in `status` is one this action starts from (a command read late, after the run moved on
        through another, is not applied)."""
        return status in TRANSITIONS[self.action][0]
