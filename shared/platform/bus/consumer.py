"""The consumer side of a work queue: `StreamConsumer`, a consumer group held until done (at-least-once;
the guarantee is in shared/platform/bus/__init__.py)."""

from __future__ import annotations

import asyncio
import contextlib
import time
import traceback
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence

from redis.exceptions import RedisError as RedisError  # re-exported: services catch it from here

from shared.contracts.messages.codec import Message, MessageDecodeError, decode
from shared.contracts.streams import failures_key
from shared.platform.bus.connect import (
    HANDLER_FAILURES,
    MESSAGES_ACKED,
    MESSAGES_RECLAIMED,
    REDIS_DOWN,
    Delivery,
    dead_letter_entry,
    surviving_data_loss,
)
from shared.platform.bus.publish import StreamBus
from shared.platform.logs import get_logger

log = get_logger(__name__)

Handler = Callable[[list[Delivery]], Awaitable[None]]
DeadLetterHook = Callable[[Delivery | None, bytes, str], Awaitable[None]]


class StreamConsumer:
    """Work queue, held until done: a consumer-group reader with reclaim, retry and dead-lettering.

    Guarantee (module docstring): at-least-once; an entry is acknowledged only after its handler returned (or
    by an explicit `ack` once its effect is durable); a dead consumer's entries are reclaimed after
    `claim_idle_ms` by the others; a failing entry is dead-lettered after `max_deliveries`, never for a
    `transient` error. The handler receives a batch of deliveries and must make their effects durable before
    returning; then the whole batch is acked. If a batch handler raises, each delivery is retried alone so
    that one poison entry cannot hold back the others.

    `claim_idle_ms=None`: entries are never reclaimed on a timer (a consumer that holds entries for as long as
    it likes takes a dead peer's over with `take_over_pending`); `max_deliveries=None`: never dead-lettered
    for the number of deliveries or failures. `block_ms=None`: `read` does not wait for new entries.
    """

    def __init__(
        self,
        bus: StreamBus,
        stream: str,
        group: str,
        consumer: str,
        *,
        expect: type[Message] | None = None,
        max_deliveries: int | None = 5,
        claim_idle_ms: int | None = 30_000,
        retry_delay_s: float = 1.0,
        batch_size: int = 64,
        block_ms: int | None = 1000,
        on_dead_letter: DeadLetterHook | None = None,
        transient: tuple[type[BaseException], ...] = (),
    ):
        self.bus, self.redis = bus, bus.redis
        self.stream, self.group, self.consumer = stream, group, consumer
        self.expect = expect
        self.max_deliveries = max_deliveries
        self.claim_idle_ms = claim_idle_ms
        self.retry_delay_s = retry_delay_s
        self.batch_size = batch_size
        self.block_ms = block_ms
        self.on_dead_letter = on_dead_letter
        self.transient = transient
        self._outage_failures = 0  # consecutive transient failures: the backoff grows with them
        self._failures_key = failures_key(stream, group)
        self._retry_at: dict[bytes, float] = {}  # own failed entries -> when to try again
        self._claim_cursor = b"0-0"

    async def start(self) -> None:
        await self.bus.ensure_group(self.stream, self.group)

    # -- reading ---------------------------------------------------------------------------------------------
    async def read(self) -> list[Delivery]:
        """Due retries first, then entries of dead consumers, then new entries (blocking up to block_ms).

        Never raises for an unreachable Redis (returns [] after a pause) nor for a group that vanished with
        Redis's data (recreates it and returns []): a consumer loop survives Redis restarts unchanged."""
        try:
            with surviving_data_loss():
                return await self._read()
        except REDIS_DOWN as e:
            log.warning("%s: Redis unavailable (%r); retrying", self.stream, e)
            await asyncio.sleep(1.0)
            return []
        # here only when the group was lost
        log.warning("%s: group %s is missing (new, or Redis lost its data); creating it", self.stream, self.group)
        self._retry_at.clear()
        self._claim_cursor = b"0-0"
        try:
            await self.start()
        except REDIS_DOWN:
            pass  # the next read tries again
        return []

    async def _read(self) -> list[Delivery]:
        raw = await self._claim_due_retries()
        raw += await self._reclaim_idle()
        if not raw:
            block = self.block_ms
            if block is not None and self._retry_at:
                block = min(block, int(self.retry_delay_s * 1000))
            resp = await self.redis.xreadgroup(
                self.group, self.consumer, {self.stream: ">"}, count=self.batch_size, block=block
            )
            raw = [(eid, fields, 1) for _, entries in resp for eid, fields in entries]
        return await self._decode_all(raw)

    async def _claim_due_retries(self) -> list[tuple[bytes, dict, int]]:
        now = time.monotonic()
        due = [eid for eid, t in self._retry_at.items() if t <= now]
        if not due:
            return []
        for eid in due:
            del self._retry_at[eid]
        claimed = await self.redis.xclaim(self.stream, self.group, self.consumer, 0, due)
        return await self._with_counts([(eid, f) for eid, f in claimed if f is not None])

    async def _reclaim_idle(self) -> list[tuple[bytes, dict, int]]:
        if self.claim_idle_ms is None:
            return []
        resp = await self.redis.xautoclaim(
            self.stream, self.group, self.consumer, self.claim_idle_ms, start_id=self._claim_cursor,
            count=self.batch_size,
        )
        self._claim_cursor = resp[0]
        claimed = [(eid, f) for eid, f in resp[1] if f is not None]
        deleted = resp[2] if len(resp) > 2 else []
        if deleted:  # trimmed while pending: nothing to deliver, release them
            await self.redis.xack(self.stream, self.group, *deleted)
        if not claimed:
            return []
        MESSAGES_RECLAIMED.labels(self.stream, self.group).inc(len(claimed))
        return await self._with_counts(claimed)

    async def _with_counts(self, entries: list[tuple[bytes, dict]]) -> list[tuple[bytes, dict, int]]:
        async with self.redis.pipeline(transaction=False) as pipe:
            for eid, _ in entries:
                pipe.xpending_range(self.stream, self.group, min=eid, max=eid, count=1)
            infos = await pipe.execute()
        out = []
        for (eid, fields), info in zip(entries, infos, strict=True):
            out.append((eid, fields, info[0]["times_delivered"] if info else 1))
        return out

    async def _decode_all(self, raw: list[tuple[bytes, dict, int]]) -> list[Delivery]:
        out: list[Delivery] = []
        for eid, fields, count in raw:
            try:
                msg = decode(fields, self.expect)
            except MessageDecodeError as e:
                await self._dead_letter(None, eid, fields, count, f"undecodable: {e}", "undecodable")
                continue
            delivery = Delivery(eid, msg, count, fields, self.stream)
            # More deliveries than allowed without a recorded failure: consumers died holding it (a poison
            # entry that crashes the process, say). Stop the crash loop.
            if self.max_deliveries is not None and count > self.max_deliveries:
                await self._dead_letter(
                    delivery, eid, fields, count, f"delivered {count} times without being acknowledged", "redelivered"
                )
                continue
            out.append(delivery)
        return out

    # -- outcomes --------------------------------------------------------------------------------------------
    async def ack(self, deliveries: Sequence[Delivery]) -> None:
        if not deliveries:
            return
        ids = [d.id for d in deliveries]
        try:  # concurrent acks (one per finished task in the rollout worker) share round trips
            batcher = self.bus.batcher
            for outcome in await asyncio.gather(batcher.call("xack", self.stream, self.group, *ids),
                                                batcher.call("hdel", self._failures_key, *ids),
                                                return_exceptions=True):
                if isinstance(outcome, BaseException):
                    raise outcome
        except REDIS_DOWN as e:
            # The effects are durable; the entries stay pending, are re-delivered later, and the idempotent
            # handler absorbs them. Losing an ack costs work, never correctness.
            log.warning("%s: ack of %d entries failed (%r); they will be re-delivered", self.stream, len(ids), e)
            return
        MESSAGES_ACKED.labels(self.stream, self.group).inc(len(ids))

    async def keep_alive(self, deliveries: Sequence[Delivery]) -> None:
        """Reset the idle time of entries this consumer is still working on, so that no other consumer takes
        them for a dead one's (call it more often than claim_idle_ms). Redis down: skipped, tried next time."""
        if not deliveries:
            return
        try:
            with surviving_data_loss() as lost:
                await self.redis.xclaim(self.stream, self.group, self.consumer, 0, [d.id for d in deliveries],
                                        justid=True)
        except REDIS_DOWN as e:
            log.warning("%s: keep-alive of %d entries failed: %r", self.stream, len(deliveries), e)
        if lost:  # the entries went with Redis's data; whoever dispatched them re-sends
            log.warning("%s: nothing to keep alive, the group is gone (Redis lost its data?)", self.stream)

    async def take_over_pending(self) -> AsyncIterator[list[Delivery]]:
        """Claim every entry the group has pending, whoever holds it and however briefly (a dead peer's, or
        this consumer's own from before a restart), page by page. Undecodable ones are dead-lettered."""
        cursor = b"0-0"
        while True:
            with surviving_data_loss() as lost:
                cursor, entries, *_ = await self.redis.xautoclaim(
                    self.stream, self.group, self.consumer, 0, start_id=cursor, count=self.batch_size)
            if lost:  # nothing pending is left with a group lost with Redis's data
                await self.bus.ensure_group(self.stream, self.group)
                return
            claimed = [(eid, f) for eid, f in entries if f is not None]
            if claimed:
                yield await self._decode_all(await self._with_counts(claimed))
            if cursor in (b"0-0", "0-0"):
                return

    async def fail(self, delivery: Delivery, error: BaseException | str) -> None:
        """Record a handler failure: retry later, or dead-letter once max_deliveries failures are reached."""
        HANDLER_FAILURES.labels(self.stream, self.group).inc()
        reason = error if isinstance(error, str) else "".join(traceback.format_exception(error))[-4000:]
        try:
            failures = await self.redis.hincrby(self._failures_key, delivery.id, 1)
            if self.max_deliveries is not None and failures >= self.max_deliveries:
                await self._dead_letter(
                    delivery, delivery.id, delivery.fields, delivery.deliveries,
                    f"handler failed {failures} times; last error: {reason}", "handler",
                )
                return
        except REDIS_DOWN:  # cannot record it now: the entry is tried again later
            failures = 1
        self._retry_at[delivery.id] = time.monotonic() + self.retry_delay_s * failures

    async def _dead_letter(
        self, delivery: Delivery | None, eid: bytes, fields: dict, count: int, reason: str, cause: str
    ) -> None:
        await dead_letter_entry(self.redis, self.stream, self.group, self.consumer, eid, fields, reason,
                                cause=cause, deliveries=count, extra_keys=[self._failures_key])
        self._retry_at.pop(eid, None)
        if self.on_dead_letter is not None:
            try:
                await self.on_dead_letter(delivery, eid, reason)
            except Exception:  # the entry is safe in the DLQ; a failing hook must not end the consumer
                log.exception("%s: on_dead_letter hook failed for %s", self.stream, eid)

    # -- loop ------------------------------------------------------------------------------------------------
    async def process(self, handler: Handler, deliveries: list[Delivery]) -> None:
        """Run the handler on a batch and ack; on failure isolate each delivery and retry it alone."""
        if not deliveries:
            return
        try:
            await handler(deliveries)
        except self.transient as e:
            await self._postpone(deliveries, e)
            return
        except Exception as batch_error:
            if len(deliveries) == 1:
                await self.fail(deliveries[0], batch_error)
                return
            for d in deliveries:
                try:
                    await handler([d])
                except self.transient as e:
                    await self._postpone([d], e)
                except Exception as e:
                    await self.fail(d, e)
                else:
                    await self.ack([d])
            return
        self._outage_failures = 0
        await self.ack(deliveries)

    async def _postpone(self, deliveries: list[Delivery], error: BaseException) -> None:
        """A transient failure: try again later (backoff up to 30 s), without counting it against the entry."""
        self._outage_failures += 1
        delay = min(self.retry_delay_s * 2 ** min(self._outage_failures - 1, 5), 30.0)
        log.warning("%s: %d entries postponed %.1fs, dependency unavailable: %r",
                    self.stream, len(deliveries), delay, error)
        try:
            async with self.redis.pipeline(transaction=False) as pipe:
                for d in deliveries:
                    # JUSTID + RETRYCOUNT: reset the idle clock and hold the delivery count where it was, so
                    # an outage never walks the entry towards the redelivery limit.
                    pipe.xclaim(self.stream, self.group, self.consumer, 0, [d.id],
                                retrycount=max(d.deliveries - 1, 0), justid=True)
                await pipe.execute()
        except REDIS_DOWN:
            pass
        for d in deliveries:
            self._retry_at[d.id] = time.monotonic() + delay

    async def run(self, handler: Handler, stop: asyncio.Event) -> None:
        """Read, handle, ack until `stop` is set. Redis outages are waited out, not fatal (`read` creates the
        group when it is missing and pauses while Redis is unreachable)."""
        with contextlib.suppress(*REDIS_DOWN):
            await self.start()
        while not stop.is_set():
            await self.process(handler, await self.read())
