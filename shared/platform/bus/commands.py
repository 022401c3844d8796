"""A command answered once, from synchronous code: `ask` announces it and `await_answer` reads its own answer
stream (the consumer answers with `StreamBus.answer`)."""

from __future__ import annotations

import time

from redis import Redis as SyncRedis
from redis.exceptions import RedisError as RedisError  # re-exported: services catch it from here

from shared.contracts.messages.codec import Message, decode
from shared.platform.bus.broadcast import announce
from shared.platform.bus.connect import ANSWER_GRACE_S, M


def ask(redis: SyncRedis, stream: str, command: Message, answer_stream: str, expect: type[M],
        wait_s: float) -> M | None:
    """Send `command` (which expires `wait_s` from now) on `stream` and wait for its answer on `answer_stream`,
    ANSWER_GRACE_S past the expiry; None without one (the sender then asks the database what happened)."""
    announce(redis, stream, command)
    return await_answer(redis, answer_stream, expect, time.monotonic() + wait_s + ANSWER_GRACE_S)


def await_answer(redis: SyncRedis, stream: str, expect: type[M], deadline: float) -> M | None:
    """The answer `StreamBus.answer` wrote on `stream`, or None at `deadline` (time.monotonic()). Redis
    unreachable meanwhile: it waits out the deadline (the sender then asks the database what happened)."""
    while (left := deadline - time.monotonic()) > 0:
        try:  # short blocks: a client with a socket timeout (the API's) would trip on a longer one
            resp = redis.xread({stream: "0-0"}, count=1, block=max(1, int(min(left, 1.0) * 1000)))
        except RedisError:
            time.sleep(min(0.2, left))
            continue
        for _, entries in resp or []:
            for _, fields in entries:
                return decode(fields, expect)
    return None
