"""Inspection: `stream_stats`, read-only figures of one stream for monitoring (the API's /metrics)."""

from __future__ import annotations

from dataclasses import dataclass

from redis import Redis as SyncRedis
from redis.exceptions import RedisError as RedisError  # re-exported: services catch it from here
from redis.exceptions import ResponseError

from shared.contracts.streams import dead_letter
from shared.platform.bus.connect import LAG_COUNT_MAX


@dataclass
class GroupStats:
    name: str
    pending: int  # delivered, not yet acknowledged
    lag: int  # not yet delivered (0 when Redis cannot tell)


@dataclass
class StreamStats:
    stream: str
    length: int
    dead_letters: int  # length of `<stream>.dlq`
    groups: list[GroupStats]


def stream_stats(redis: SyncRedis, stream: str) -> StreamStats:
    """Read-only figures of one stream for monitoring (synchronous: the API's /metrics). A stream that does not
    exist yet has length 0 and no groups."""
    try:
        groups = redis.xinfo_groups(stream)
    except ResponseError:  # no such stream
        groups = []
    return StreamStats(stream, redis.xlen(stream), redis.xlen(dead_letter(stream)), [
        GroupStats(g["name"].decode() if isinstance(g["name"], bytes) else g["name"], g["pending"], _lag(redis, stream, g))
        for g in groups])


def _lag(redis: SyncRedis, stream: str, group: dict) -> int:
    """Entries not yet delivered to `group`: XINFO's `lag` on Redis 7 (0 where Redis cannot tell, after deletions);
    Redis 6.2 (the embedded one) has no such field, so the entries after the group's last delivered id are
    counted, up to LAG_COUNT_MAX."""
    if "lag" in group:
        return group["lag"] or 0
    last = group["last-delivered-id"]
    return len(redis.xrange(stream, min="(" + (last.decode() if isinstance(last, bytes) else last), max="+",
                            count=LAG_COUNT_MAX))
