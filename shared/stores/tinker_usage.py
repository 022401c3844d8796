"""Tinker usage: tokens trained, tokens prefilled and sampled, and checkpoints saved, per key, UTC hour,
session and base model. The trainer and the rollout workers count each answered request once, however often it
is answered (a redelivery after a crash); the API reports the counts (GET /api/v1/billing/usage/events).

Each hour of a key is one Redis hash, `tinker:usage:<owner>:<hour>`, kept USAGE_TTL_S. More: docs/tinker.md#usage
"""

from __future__ import annotations

import json
from typing import Any, NamedTuple

from shared.contracts.streams import tinker_key
from shared.contracts.tinker_run import FUTURE_TTL_S

USAGE_TTL_S = 90 * 24 * 3600  # an hour's counts are kept 90 days (the SDK asks for at most 14 at a time)
# sampling_prefill_cached: prompt tokens the engine served from its prefix cache (reported as cached prefill)
KINDS = ("training", "sampling_prefill", "sampling_prefill_cached", "sampling_sample", "checkpoint")

# The request's mark, then its counts: a request counted before (its mark is there) adds nothing. The mark
# outlives any redelivery of the request: its future expires with it.
_COUNT_ONCE = """
if redis.call('SET', KEYS[1], '1', 'NX', 'EX', ARGV[1]) then
  for i = 3, #ARGV, 2 do redis.call('HINCRBY', KEYS[2], ARGV[i], ARGV[i + 1]) end
  redis.call('EXPIRE', KEYS[2], ARGV[2])
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
