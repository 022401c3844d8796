"""The Redis streams transport every service uses (redis-py asyncio), one module per pattern: work queue,
request/reply, command answered once, broadcast, inspection. No service issues stream commands or imports
`redis` itself; `connect` / `connect_sync` make the clients.

Work queue guarantee: **at-least-once**. A consumer acknowledges an entry only after `handler` returned, so
every handler must be idempotent. A dead consumer's entries are reclaimed; one that keeps failing or does not
decode goes to `<stream>.dlq`; transient errors are retried, never dead-lettered. Not guaranteed: ordering
across consumers, exactly-once effects, durability beyond Redis's. Postgres is the source of truth.

More: docs/reliability.md#the-redis-bus
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
    parse_stream_id,
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
    "connect", "connect_sync", "data_lost", "dead_letter_entry", "decode_or_skip", "parse_stream_id", "redis_time", "stream_stats",
    "surviving_data_loss",
]
