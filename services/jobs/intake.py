"""The intake: group "jobs" on `jobs.requests` -> the job's `queued` row (its id the one the sender chose), the
Celery task sent by name, then the `JobRequestReply` on the request's answer stream (shared/contracts/messages/jobs.py).
It runs beside the Celery worker in each jobs service process; with several, each request is stored by one.

Idempotent by job id: a request delivered again (its intake died before the ack) finds its row. While that row
is still `queued` the task is sent again, since the first send may not have happened; the worker runs a job's
task delivered twice once (celery_app). A request read after its sender's wait (`expires_at - sent_at`, its age
on Redis's clock) is answered `expired` and stored nowhere: its sender has already told its caller that nothing
was queued. An unknown kind is stored as a failed job that says so."""

from __future__ import annotations

import asyncio
import uuid

from celery import Celery
from kombu.exceptions import OperationalError as BrokerUnreachable
from sqlalchemy import Engine, func, update
from sqlalchemy.exc import OperationalError as DatabaseUnreachable
from sqlalchemy.orm import Session

from shared.clients.jobs import JOB_TASKS
from shared.contracts.db.models import Job
from shared.contracts.messages import JobRequest, JobRequestReply
from shared.contracts.streams import GROUP_JOBS, JOB_REQUESTS, job_reply
from shared.platform.bus import Delivery, StreamBus, StreamConsumer, redis_time
from shared.platform.logs import get_logger

log = get_logger(__name__)


class JobIntake:
    def __init__(self, worker_id: str, engine: Engine, bus: StreamBus, celery: Celery):
        self.engine, self.bus, self.celery = engine, bus, celery
        # the database down means "not now": retried until it is back, never dead-lettered for it
        self.consumer = StreamConsumer(bus, JOB_REQUESTS, GROUP_JOBS, worker_id, expect=JobRequest,
                                       transient=(DatabaseUnreachable,))

    async def run(self, stop: asyncio.Event) -> None:
        await self.consumer.run(self.apply, stop)

    async def apply(self, deliveries: list[Delivery]) -> None:
        now = await redis_time(self.bus.redis)  # the request's age on one clock, Redis's (Delivery.age_s)
        for d in deliveries:
            req: JobRequest = d.message
            reply = await asyncio.to_thread(self.store, req, d.age_s(now) > req.expires_at - req.sent_at)
            log.info("job %s (%s): %s", req.job_id, req.kind, reply.outcome)
            await self.bus.answer(job_reply(req.job_id), reply)

    def store(self, req: JobRequest, expired: bool) -> JobRequestReply:
        """The request as a `queued` job with its task sent; `expired` (read too late) stores nothing."""
        job_id = uuid.UUID(req.job_id)
        with Session(self.engine, expire_on_commit=False) as s:
            job = s.get(Job, job_id)
            if job is None and expired:
                return JobRequestReply(job_id=req.job_id, outcome="expired",
                                       message="read after its sender stopped waiting; nothing was queued")
            if job is None:
                job = Job(id=job_id, kind=req.kind, params=req.params, result={},
                          run_id=uuid.UUID(req.run_id) if req.run_id else None, status="queued")
                if req.kind not in JOB_TASKS:
                    job.status, job.error = "failed", f"unknown job kind {req.kind!r}: one of {', '.join(JOB_TASKS)}"
                s.add(job)
                s.commit()
            status = job.status
        if status == "queued":
            self.send(req)
        return JobRequestReply(job_id=req.job_id, outcome="queued")

    def send(self, req: JobRequest) -> None:
        try:
            self.celery.send_task(JOB_TASKS[req.kind], args=[req.job_id], task_id=req.job_id)
        except BrokerUnreachable as e:  # recorded on the job: its caller sees why it never ran
            with Session(self.engine) as s:
                s.execute(update(Job).where(Job.id == uuid.UUID(req.job_id), Job.status == "queued")
                          .values(status="failed", error=f"the job queue (Redis) is unreachable: {e}",
                                  finished_at=func.now()))
                s.commit()
