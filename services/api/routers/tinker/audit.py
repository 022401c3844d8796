"""The audit log (the SDK's `AdminClient.get_audit_log`): what was done to a key's checkpoints and sessions and by
whom, one UTC day at a time. An event is filed under the key that acted and the key whose checkpoint it was (a
read of a published checkpoint shows in both logs)."""

from __future__ import annotations

from datetime import UTC, date, datetime, timedelta
from typing import Any, Literal

from fastapi import APIRouter, Request

from services.api.auth import needs
from services.api.routers.tinker.callers import Caller, Key, store

router = APIRouter()

# The SDK's event types, each the `<resource>_` its events start with (teams and organizations: none recorded here)
EVENT_TYPES = {"checkpoints": "checkpoint_", "projects": "project_", "teams": "team_", "organizations": "organization_"}


def record(request: Request, caller: Caller | None, event: str, owner: str | None = None, **details: Any) -> None:
    """Audit `event` (`<resource>_<action>`) done by `caller` (None: the holder of a signed URL) to something of
    `owner` (None: the caller's own)."""
    actor = {"actor": caller.principal.name} if caller else {"actor": None, "via": "signed URL"}
    owners = {o for o in (owner, caller and caller.owner) if o}
    store(request).audit(owners, event, actor | details)


@router.get("/audit")
@needs("read")
def audit_log(caller: Key, request: Request, event_type: Literal["all", "checkpoints", "projects", "teams",
                                                                "organizations"] = "all",
              day: date | None = None) -> dict:
    start = datetime.combine(day or datetime.now(UTC).date(), datetime.min.time(), UTC)
    end = start + timedelta(days=1)
    prefix = EVENT_TYPES.get(event_type, "")
    entries = []
    for ms, event, details in store(request).audit_log(caller.owner, int(start.timestamp() * 1000),
                                                       int(end.timestamp() * 1000)):
        if event.startswith(prefix):
            deprecated = {k: details.get(k) for k in ("model_id", "tinker_path", "purpose") if k in details}
            entries.append({"timestamp": datetime.fromtimestamp(ms / 1000, UTC).isoformat(), "event": event,
                            "event_details": details, **deprecated})
    return {"entries": entries}
