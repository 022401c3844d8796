"""Job requests: `jobs.requests` (API -> jobs service). The jobs service is the one writer of `jobs`: its intake
(group "jobs") stores the request as the job's `queued` row, under the id the sender chose, sends the Celery task
and answers on the request's own answer stream with a `JobRequestReply`. Storing is idempotent by job id, so a
request delivered twice (its intake died before the ack) is one job. A request read after its `expires_at` is
answered `expired` and not stored: its sender has stopped waiting and told its caller that nothing was queued
(shared/clients/jobs.py `request_job`).
"""

from __future__ import annotations

from typing import Any, Literal

from shared.contracts.messages.codec import Message


class JobRequest(Message):
    TYPE = "job_request"
    SCHEMA_VERSION = 1

    job_id: str  # chosen by the sender, so a redelivery cannot make two jobs
    kind: str  # a key of shared.clients.jobs.JOB_TASKS
    params: dict[str, Any]
    run_id: str | None = None  # the run the job is about (an export)
    sent_at: float  # unix seconds, the sender's clock
    expires_at: float  # unix seconds: not stored when read later (the sender gave up at this time)


class JobRequestReply(Message):
    TYPE = "job_request_reply"
    SCHEMA_VERSION = 1

    job_id: str
    outcome: Literal["queued", "expired"]  # queued: the row is stored and the task sent (or sent before)
    message: str = ""
