"""Tinker usage: tokens trained, tokens prefilled and sampled, checkpoints saved and the storage they held, per
key, UTC hour, session and base model. The trainer and the rollout workers count each answered request (and the
trainer each checkpoint it removes) once, however often it is answered (a redelivery after a crash); the API
reports the counts (GET /api/v1/billing/usage/events).

Each hour of a key is one Redis hash, `tinker:usage:<owner>:<hour>`, kept USAGE_TTL_S. More: docs/tinker.md#usage
"""

from __future__ import annotations

import json
from typing import Any, NamedTuple

from shared.contracts.streams import tinker_key
from shared.contracts.tinker_run import FUTURE_TTL_S

USAGE_TTL_S = 90 * 24 * 3600  # an hour's counts are kept 90 days (the SDK asks for at most 14 at a time)
# sampling_prefill_cached: prompt tokens the engine served from its prefix cache (reported as cached prefill);
# storage: byte-seconds a checkpoint held in the hour (reported as gigabyte-hours), counted when the trainer
# removes it; the API adds what the checkpoints still recorded hold (held_byte_seconds)
KINDS = ("training", "sampling_prefill", "sampling_prefill_cached", "sampling_sample", "checkpoint", "storage")

# The request's mark, then its counts: a request counted before (its mark is there) adds nothing. The mark
# outlives any redelivery of the request: its future expires with it.
_COUNT_ONCE = """
if redis.call('SET', KEYS[1], '1', 'NX', 'EX', ARGV[1]) then
  for i = 3, #ARGV, 2 do redis.call('HINCRBY', KEYS[2], ARGV[i], ARGV[i + 1]) end
  redis.call('EXPIRE', KEYS[2], ARGV[2])
end
return 0
"""


# The same, for counts spread over several hours (KEYS[2..]: the hours' hashes, ARGV[4..]: their counts).
_COUNT_HOURS_ONCE = """
if redis.call('SET', KEYS[1], '1', 'NX', 'EX', ARGV[1]) then
  for i = 2, #KEYS do
    redis.call('HINCRBY', KEYS[i], ARGV[3], ARGV[i + 2])
    redis.call('EXPIRE', KEYS[i], ARGV[2])
  end
end
return 0
"""


class UsageCount(NamedTuple):
    hour: int  # hours since the epoch, UTC
    kind: str  # one of KINDS
    session_id: str | None
    base_model: str | None
    count: int


def usage_key(owner: str, hour: int) -> str:
    return tinker_key("usage", f"{owner}:{hour}")


def count_once(pipe: Any, owner: str, request_id: str, session_id: str | None, base_model: str | None,
               counts: dict[str, int], at: float) -> None:
    """Queue on `pipe` (a Redis pipeline or client, sync or async) the counts of request `request_id`, answered
    at unix time `at`, as its key's usage; a request counted before adds nothing."""
    unknown = set(counts) - set(KINDS)
    if unknown:
        raise ValueError(f"unknown usage kinds {sorted(unknown)}; the kinds are {KINDS}")
    fields = [x for kind, n in counts.items() if n for x in (json.dumps([kind, session_id, base_model]), int(n))]
    if fields:
        pipe.eval(_COUNT_ONCE, 2, tinker_key("usage_counted", request_id), usage_key(owner, int(at // 3600)),
                  FUTURE_TTL_S, USAGE_TTL_S, *fields)


def usage(redis: Any, owner: str, first_hour: int, end_hour: int) -> list[UsageCount]:
    """The key's counts of the hours from `first_hour` up to (not including) `end_hour` (a sync client)."""
    pipe = redis.pipeline(transaction=False)
    hours = range(first_hour, end_hour)
    for hour in hours:
        pipe.hgetall(usage_key(owner, hour))
    out = []
    for hour, fields in zip(hours, pipe.execute(), strict=True):
        for field, n in fields.items():
            kind, session_id, base_model = json.loads(field)
            out.append(UsageCount(hour, kind, session_id, base_model, int(n)))
    return out


def held_byte_seconds(size_bytes: int, start: float, end: float) -> dict[int, int]:
    """Per UTC hour (hours since the epoch), the byte-seconds `size_bytes` held from `start` to `end`: storage
    as a count (a gigabyte-hour is 3.6e12 of them)."""
    out: dict[int, int] = {}
    t = max(start, end - USAGE_TTL_S)  # older hours are no longer kept
    while t < end:
        hour = int(t // 3600)
        until = min(end, (hour + 1) * 3600)
        out[hour] = out.get(hour, 0) + round(size_bytes * (until - t))
        t = until
    return {hour: n for hour, n in out.items() if n}


def count_storage_once(pipe: Any, owner: str, mark: str, base_model: str | None, size_bytes: int, start: float,
                       end: float) -> None:
    """Queue on `pipe` the storage a checkpoint held from `start` to `end` as its owner's usage, per hour; a
    `mark` counted before adds nothing (a checkpoint removed twice)."""
    per_hour = held_byte_seconds(size_bytes, start, end)
    if per_hour:
        keys = [tinker_key("usage_counted", mark), *(usage_key(owner, hour) for hour in per_hour)]
        pipe.eval(_COUNT_HOURS_ONCE, len(keys), *keys, FUTURE_TTL_S, USAGE_TTL_S,
                  json.dumps(["storage", None, base_model]), *per_hour.values())
