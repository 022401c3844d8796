"""`run.control` (API -> controller and trainer): a user's pause, resume or stop of a run.

The API answers the request at once: it changes `runs.status` by compare-and-set along `TRANSITIONS` (409 when
the run is in no status the action starts from), commits, then publishes a `RunControl`. The controller
(group "controller") and the trainer (group "train") apply it to the run they drive or train as soon as they
read it, and acknowledge it then. One that does not drive or train the run acknowledges it untouched: with
several controllers (or trainers) in a group, the one holding the run then reads the status at its next poll of
the runs it leases, which is also how a command lost with Redis's data still takes effect.
"""

from __future__ import annotations

from typing import Literal

from shared.messages.codec import Message

Action = Literal["pause", "resume", "stop"]

# action -> (statuses it is allowed from, status it sets)
TRANSITIONS: dict[str, tuple[tuple[str, ...], str]] = {
    "pause": (("running",), "paused"),
    "resume": (("paused",), "running"),
    "stop": (("pending", "running", "paused"), "stopping"),
}


class RunControl(Message):
    TYPE = "run_control"
    SCHEMA_VERSION = 1

    run_id: str
    action: Action
    sent_at: float = 0.0  # unix seconds, the API's clock

    @property
    def status(self) -> str:
        """The status the action sets."""
        return TRANSITIONS[self.action][1]

    def applies_to(self, status: str) -> bool:
        """Whether a run in `status` is one this action starts from (a command read late, after the run moved on
        through another, is not applied)."""
        return status in TRANSITIONS[self.action][0]
