"""Runs addressed as people address them: by id, by a unique prefix of the id, or by name (as git and docker
do). Every route that takes a run in its path takes such a reference (`RunId`), so `GET /v1/runs/recall-grpo`
and `GET /v1/runs/3a52` work as `GET /v1/runs/3a529841-cdb1-4064-a173-0df855161ad8` does.

Resolution order: a full UUID is that id; then a run whose name is exactly the reference; then ids starting with
it. Several runs with the name, or several ids with the prefix, is a 400 that lists them (the newest first)
and asks for more of the id; no match is a 404 that names the closest run names."""

from __future__ import annotations

import difflib
import re
import uuid
from typing import Annotated

from fastapi import Depends, Path
from sqlalchemy import String, cast, select

from services.api.deps import DB
from services.api.errors import ApiError
from shared.contracts.db.models import Run

HEX_PREFIX = re.compile(r"^[0-9a-fA-F-]+$")
SHOWN = 10  # matches listed in an ambiguity error


def resolve_run(session, ref: str, field: str = "run_id") -> uuid.UUID:
    """The id of the run `ref` names (a full id, a run name, or a unique id prefix); ApiError 400 when it is
    ambiguous, 404 when nothing matches. A full id is returned as is (the caller's lookup answers 404)."""
    ref = ref.strip()
    try:
        return uuid.UUID(ref)
    except ValueError:
        pass
    cols = (Run.id, Run.name, Run.status, Run.created_at)
    rows = session.execute(select(*cols).where(Run.name == ref).order_by(Run.created_at.desc())
                           .limit(SHOWN + 1)).all()
    what = f"{len(rows) if len(rows) <= SHOWN else f'more than {SHOWN}'} runs are named {ref!r}"
    if not rows and HEX_PREFIX.match(ref):
        rows = session.execute(select(*cols).where(cast(Run.id, String).like(ref.lower() + "%"))
                               .order_by(Run.created_at.desc()).limit(SHOWN + 1)).all()
        what = f"{len(rows) if len(rows) <= SHOWN else f'more than {SHOWN}'} run ids start with {ref!r}"
    if len(rows) == 1:
        return rows[0].id
    if rows:
        listed = "; ".join(f"{r.id} ({r.name}, {r.status}, created {r.created_at:%Y-%m-%d %H:%M:%S})"
                           for r in rows[:SHOWN])
        raise ApiError(400, f"run {ref!r} is ambiguous: {what}: {listed}", field=field,
                       hint="give the full id or a longer prefix of it")
    names = session.execute(select(Run.name).distinct().limit(10_000)).scalars().all()
    close = difflib.get_close_matches(ref, names, n=3, cutoff=0.6)
    hint = (f"did you mean {' or '.join(map(repr, close))}? " if close else "") + \
        "a run is named by its id, a unique prefix of its id, or its name; list runs with GET /v1/runs " \
        "(`flywheel runs list`)"
    raise ApiError(404, f"no run has the id or name {ref!r}", field=field, hint=hint)


def run_ref(run_id: Annotated[str, Path(min_length=1, max_length=200,
                                        description="the run's id, a unique prefix of its id, or its name")],
            session: DB) -> uuid.UUID:
    return resolve_run(session, run_id)


RunId = Annotated[uuid.UUID, Depends(run_ref)]
