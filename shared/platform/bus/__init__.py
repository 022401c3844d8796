"""The Redis streams transport every service uses (redis-py asyncio), one module per pattern. No service issues
stream commands itself; it uses one of these patterns, each of whose class docstring states its delivery guarantee (checked by
tests/component/test_bus.py and test_bus_patterns.py); which stream travels by which: STREAM_TABLE in
shared/contracts/streams.py.

| pattern (module) | producer side | consumer side |
|---|---|---|
| work queue, held until done (publish, consumer) | `StreamBus.publish` / `publish_many` | `StreamConsumer` (a consumer group) |
| request/reply (request_reply) | `RequestClient.call` / `send` | `RequestServer` (group on a shared stream + own inbox) |
| command, answered once (commands) | `ask` (sync: `announce`, then `await_answer` on the command's own answer stream) | `StreamConsumer`, then `StreamBus.answer` |
| broadcast (broadcast) | `StreamBus.publish`, `announce` (sync) | `BroadcastReader` (own cursor, no group) |
| inspection (stats) | - | `stream_stats` (sync, read-only) |

This package (connect.py) is also the only door to Redis for services: `connect` (asyncio) and `connect_sync` make the
clients, `Redis` / `SyncRedis` are their types and `RedisError` the base of redis-py's errors. Services never
import `redis` themselves (tests/contract/test_layering.py), so how a client is built (pool, timeouts, keepalive
for TCP only) is decided here once.

Work queue guarantee: **at-least-once**. A consumer acknowledges an entry only after `handler` returned, i.e.
after its effect is durable; so a crash between effect and ack re-delivers the entry, and every handler must
be idempotent (natural keys make duplicates harmless). Specifically:

- `publish` appends with an approximate MAXLEN cap (a safety bound; producers apply backpressure so the cap is
  not reached in normal operation) and `trim_acknowledged` trims only entries every group has acknowledged.
- A consumer that dies leaves its entries pending; any consumer of the group claims them with XAUTOCLAIM once
  they are idle for `claim_idle_ms` (a consumer working on an entry for longer calls `keep_alive`).
- An entry whose handler raised is retried (XCLAIM to self) after `retry_delay_s`; after `max_deliveries`
  failures, or deliveries by consumers that died, it goes to `<stream>.dlq` with the reason, and is acked.
  Exceptions the consumer declares `transient` (its database is down, say) mean "not now", not "poison":
  the entry is retried with backoff for as long as it takes and never dead-lettered for them.
- An entry that does not decode (or exceeds the codec's size limit) is dead-lettered at once; it never reaches
  the handler or crashes the loop. Readers without a group (`weights`, `env.replies.*`) skip and count it
  instead (`decode_or_skip`).

Not guaranteed: ordering across consumers, exactly-once effects (that is the handlers' idempotency), and
durability beyond what Redis itself gives (AOF in compose). Postgres is the source of truth; the controller
re-dispatches work whose result never arrived.
"""

from shared.platform.bus.broadcast import BroadcastReader, announce
from shared.platform.bus.commands import ask, await_answer
from shared.platform.bus.connect import (
    ANSWER_GRACE_S,
    ANSWER_TTL_S,
    DEFAULT_MAXLEN,
    REDIS_DOWN,
    DataLoss,
    Delivery,
    Redis,
    RedisError,
    SyncRedis,
    connect,
    connect_sync,
    data_lost,
    dead_letter_entry,
    decode_or_skip,
    redis_time,
    surviving_data_loss,
)
from shared.platform.bus.consumer import DeadLetterHook, Handler, StreamConsumer
from shared.platform.bus.publish import CommandBatcher, StreamBus
from shared.platform.bus.request_reply import REPLY_RETRY, RequestClient, RequestServer
from shared.platform.bus.stats import GroupStats, StreamStats, stream_stats

__all__ = [
    "ANSWER_GRACE_S", "ANSWER_TTL_S", "DEFAULT_MAXLEN", "REDIS_DOWN", "REPLY_RETRY", "BroadcastReader", "CommandBatcher",
    "DataLoss", "DeadLetterHook", "Delivery", "GroupStats", "Handler", "Redis", "RedisError", "RequestClient",
    "RequestServer", "StreamBus", "StreamConsumer", "StreamStats", "SyncRedis", "announce", "ask", "await_answer",
    "connect", "connect_sync", "data_lost", "dead_letter_entry", "decode_or_skip", "redis_time", "stream_stats",
    "surviving_data_loss",
]
