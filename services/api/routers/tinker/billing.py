"""Usage (the SDK's `AdminClient.get_billing_usage` and `get_current_checkpoint_storage_usage`): what a key
trained, sampled, saved and stored, per UTC hour, session and base model (shared/stores/tinker_usage.py), and the
checkpoints it stores now; priced by the operator's rate card (TINKER_RATE_CARD), null where it sets no price."""

from __future__ import annotations

import time
from collections import defaultdict
from datetime import UTC, datetime, timedelta
from typing import Annotated

from fastapi import APIRouter, Query, Request

from services.api.auth import needs
from services.api.deps import Config
from services.api.errors import ApiError
from services.api.routers.tinker.callers import Key, store
from services.api.routers.tinker.checkpoints import stored_bytes
from services.api.settings import TinkerRateCard
from shared.contracts.tinker_run import session_of_model
from shared.stores.tinker_usage import UsageCount, held_byte_seconds, usage

router = APIRouter()

MAX_WINDOW = timedelta(days=14)  # the SDK's documented longest window
GIGABYTE = 10**9
BYTE_SECONDS_PER_GB_HOUR = GIGABYTE * 3600
GB_HOURS_PER_MONTH = 720  # Tinker's GB-month


def _hour(value: datetime, field: str) -> int:
    """`value` as hours since the epoch; 400 unless it is a whole UTC hour."""
    value = value if value.tzinfo else value.replace(tzinfo=UTC)
    if (value.minute, value.second, value.microsecond) != (0, 0, 0):
        raise ApiError(400, f"{field} {value.isoformat()} is not on a UTC hour boundary", field=field,
                       hint=f"give a whole hour, such as {value.replace(minute=0, second=0, microsecond=0).isoformat()}")
    return int(value.timestamp()) // 3600


@router.get("/billing/usage/events")
@needs("read")
def billing_usage(caller: Key, request: Request, config: Config, starting_on: Annotated[datetime, Query()],
                  ending_before: Annotated[datetime, Query()]) -> dict:
    """Hourly usage buckets from `starting_on` up to `ending_before` (whole UTC hours, at most 14 days, not
    starting in the future), ordered by bucket then by descending quantity."""
    first, end = _hour(starting_on, "starting_on"), _hour(ending_before, "ending_before")
    now_hour = int(datetime.now(UTC).timestamp()) // 3600
    if first > now_hour:
        raise ApiError(400, f"starting_on {starting_on.isoformat()} is in the future", field="starting_on",
                       hint="start at the current hour or earlier")
    if not first < end <= first + MAX_WINDOW // timedelta(hours=1):
        raise ApiError(400, f"ending_before must be after starting_on and at most 14 days after it (got "
                       f"{(end - first)} hours)", field="ending_before", hint="ask for 14 days at a time at most")
    tinker = store(request)
    sessions = dict(tinker.session_records(caller.owner))
    counts = usage(request.app.state.redis, caller.owner, first, end) + held_now(tinker, caller.owner, first, end)
    events = []
    for c in sorted(merged(counts), key=lambda c: (c.hour, -c.count, c.kind, c.session_id or "", c.base_model or "")):
        events.append(event(c, caller, sessions, config.tinker_rate_card))
    seen = {e["session_id"] for e in events if e["session_id"] in sessions}
    return {"data": events, "cost_data_through": None,
            "sessions": {s: {"user_metadata": {k: str(v) for k, v in sessions[s]["user_metadata"].items()} or None}
                         for s in sorted(seen)}}


def held_now(tinker, owner: str, first: int, end: int) -> list[UsageCount]:
    """The storage of the checkpoints still recorded (live, or deleted and not yet removed by the trainer, which
    counts a checkpoint's storage when it removes it), in hours first..end."""
    now = time.time()
    counts = []
    for record in tinker.checkpoints(owner, expired=True):
        size = stored_bytes(record)
        until = min(now, record.get("expires_at") or now)
        for hour, n in held_byte_seconds(size or 0, record["created_at"], until).items():
            if first <= hour < end:
                counts.append(UsageCount(hour, "storage", None, record.get("base_model"), n))
    return counts


def merged(counts: list[UsageCount]) -> list[UsageCount]:
    """One count per hour, kind, session and base model."""
    totals: dict[tuple, int] = defaultdict(int)
    for c in counts:
        totals[c[:4]] += c.count
    return [UsageCount(*key, n) for key, n in totals.items()]


def event(c: UsageCount, caller, sessions: dict, card: TinkerRateCard) -> dict:
    """A count as the SDK's BillingUsageEvent, priced by `card` (checkpoint operations are not priced)."""
    prices: dict[str, float | None] = {}
    if c.kind == "storage":
        info = {"type": "storage", "free": False, "gigabyte_hours": c.count / BYTE_SECONDS_PER_GB_HOUR}
        if (rate := card.rate(c.base_model, "storage_gb_month")) is not None:
            prices = {"effective_rate_usd_per_gigabyte_month": rate,
                      "estimated_cost_usd": rate * info["gigabyte_hours"] / GB_HOURS_PER_MONTH}
    else:
        kind = "sampling_prefill" if c.kind == "sampling_prefill_cached" else c.kind
        info = {"type": kind, **({"count": c.count} if kind == "checkpoint" else {"token_count": c.count})}
        if kind == "sampling_prefill":
            info["cached"] = c.kind == "sampling_prefill_cached"
        if kind != "checkpoint" and (rate := card.rate(c.base_model, c.kind)) is not None:
            prices = {"effective_rate_usd_per_million_tokens": rate, "estimated_cost_usd": rate * c.count / 1e6}
    session = sessions.get(c.session_id or "", {})
    start = datetime.fromtimestamp(c.hour * 3600, UTC)
    return {"bucket_start": start.isoformat(), "bucket_end": (start + timedelta(hours=1)).isoformat(),
            "base_model": c.base_model, "user_id": caller.owner,
            "user_name": session.get("owner_name") or caller.principal.name, "session_id": c.session_id,
            "project_id": session.get("project_id"), "event_info": info, **prices}


@router.get("/billing/usage/checkpoints/current")
@needs("read")
def checkpoint_storage(caller: Key, request: Request, config: Config, project_id: str | None = None) -> dict:
    """The key's live checkpoints, their count and stored bytes, per project (of their model's session), and what
    a month of them costs at the rate card's storage price of each one's base model (null while any is unpriced)."""
    tinker, card = store(request), config.tinker_rate_card
    projects = {s: record.get("project_id") for s, record in tinker.session_records(caller.owner)}
    totals: dict[str | None, list] = defaultdict(lambda: [0, 0, 0.0])
    for record in tinker.checkpoints(caller.owner):
        project = projects.get(session_of_model(record["model_id"]))
        if project_id is None or project == project_id:
            size, rate = stored_bytes(record) or 0, card.rate(record.get("base_model"), "storage_gb_month")
            totals[project][0] += 1
            totals[project][1] += size
            totals[project][2] = None if rate is None or totals[project][2] is None else (
                totals[project][2] + rate * size / GIGABYTE)
    return {"effective_rate_usd_per_gigabyte_month": card.default.storage_gb_month,
            "data": [{"project_id": project, "org_user_urn": caller.owner, "user_name": caller.principal.name,
                      "checkpoint_count": count, "size_bytes": size, "size_gigabytes": size / GIGABYTE,
                      "estimated_monthly_cost_usd": cost}
                     for project, (count, size, cost) in sorted(totals.items(), key=lambda t: t[0] or "")]}
