"""Who is alive: the one reader of the heartbeats every service process writes (shared/platform/service.py refreshes
`heartbeat:<service>:<worker id>` every HEARTBEAT_INTERVAL_S with a TTL of three intervals, and deletes it on a
clean stop). The controller sizes and explains dispatch with them, the API finds rollout workers' engines and
agent gateways with them.

    workers = live_workers(sync_client, "rollout-worker")            # the API (its routes run in threads)
    workers = await live_workers_async(redis, "rollout-worker")      # the controller

A heartbeat that is not a JSON object of the expected shape (a foreign or older writer) is skipped; Redis
errors propagate (`shared.platform.bus.RedisError`): each caller decides what "cannot tell" means for it.
"""

from __future__ import annotations

import json

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from shared.contracts.streams import heartbeat_pattern
from shared.platform.bus import Redis, SyncRedis

SCAN_COUNT = 500


class Heartbeat(BaseModel):
    """What a live process says about itself (`ServiceRuntime.health()`: its identity plus the service's own
    status entries). Status entries this model does not name are kept as extra fields."""

    model_config = ConfigDict(extra="allow")

    service: str = ""  # every field has a default: a heartbeat is judged by the fields its reader needs
    worker_id: str = ""
    pid: int | None = None
    port: int | None = None  # of its /healthz and /metrics
    uptime_s: float = 0.0
    stopping: bool = False  # draining after SIGTERM: alive, but taking no new work
    unreachable: list[str] = Field(default_factory=list)  # dependencies it cannot reach now ("postgres")
    # rollout workers
    engines: list[str] | None = None  # engine types it can run; None: it does not say
    max_concurrency: int = 0  # rollout slots
    inflight: int = 0  # slots busy now
    gateway_url: str | None = None  # where external agent programs claim sessions
    holds: list[tuple[str, str, int, int]] = Field(default_factory=list)  # (run, task, sample, attempt) running here
    # trainers
    trains: list[str] = Field(default_factory=list)  # the runs it trains (holds the trainer lease of, opened)


def parse_heartbeats(values: list[bytes | str | None]) -> list[Heartbeat]:
    """The heartbeats among raw key values (None: the key expired between SCAN and MGET)."""
    out = []
    for raw in values:
        if not raw:
            continue
        try:
            out.append(Heartbeat.model_validate(json.loads(raw)))
        except (ValueError, ValidationError):  # ValidationError is a ValueError; named for the reader
            continue
    return out


def live_workers(redis: SyncRedis, service: str) -> list[Heartbeat]:
    """The heartbeats of `service`'s live processes (stopping ones included: filter on `.stopping`)."""
    keys = list(redis.scan_iter(match=heartbeat_pattern(service), count=SCAN_COUNT))
    return parse_heartbeats(redis.mget(keys) if keys else [])


async def live_workers_async(redis: Redis, service: str) -> list[Heartbeat]:
    """`live_workers` on an asyncio client."""
    keys = [k async for k in redis.scan_iter(match=heartbeat_pattern(service), count=SCAN_COUNT)]
    return parse_heartbeats(await redis.mget(keys) if keys else [])
