"""Read-only SQL over the stored runs: one statement, run as the `flywheel_reader` role inside a READ ONLY
transaction with a statement timeout, always rolled back.

What protects the database: the role has SELECT only; the transaction is read-only; a prepared statement
holds exactly one command (so `...; DELETE ...` is refused by Postgres itself); statements that switch
roles or settings are refused here. When the API's own DATABASE_URL is a superuser, set SQL_DATABASE_URL to a
LOGIN role in flywheel_reader for untrusted users: then no statement can switch back to the API's role."""

from __future__ import annotations

import base64
import datetime as dt
import decimal
import math
import re
import uuid
from typing import Annotated, Any

import psycopg
from fastapi import APIRouter
from pydantic import Field
from sqlalchemy.engine import make_url

from services.api.auth import needs
from services.api.deps import Config
from services.api.errors import ApiError, StrictBody, errors, int_in
from services.api.schemas import SqlResult

router = APIRouter(tags=["sql"])
READER_ROLE = "flywheel_reader"
FORBIDDEN = re.compile(r"^\s*(set|reset)\b|\bset_config\s*\(|\bsession_authorization\b", re.IGNORECASE)


class SqlRequest(StrictBody):
    query: Annotated[str, Field(min_length=1, max_length=100_000, description="one SELECT/WITH statement")]
    max_rows: int_in(1, 100_000) | None = None  # type: ignore[valid-type]


def _cell(v: Any) -> Any:
    if isinstance(v, float):
        return v if math.isfinite(v) else str(v)
    if isinstance(v, decimal.Decimal):
        return float(v) if v.is_finite() else str(v)
    if isinstance(v, (bytes, memoryview)):
        return base64.b64encode(bytes(v)).decode()
    if isinstance(v, (dt.datetime, dt.date, dt.time)):
        return v.isoformat()
    if isinstance(v, (uuid.UUID, dt.timedelta)):
        return str(v)
    if isinstance(v, dict):
        return {str(k): _cell(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_cell(x) for x in v]
    return v if v is None or isinstance(v, (str, int, bool)) else str(v)


def _dsn(url: str) -> str:
    return make_url(url).set(drivername="postgresql").render_as_string(hide_password=False)


def run_readonly(dsn: str, query: str, timeout_s: float, max_rows: int, switch_role: bool) -> dict:
    with psycopg.connect(dsn, autocommit=False, connect_timeout=10) as conn:
        with conn.cursor() as cur:
            cur.execute("SET TRANSACTION READ ONLY")
            if switch_role:
                cur.execute(f"SET LOCAL ROLE {READER_ROLE}")
            cur.execute("SELECT set_config('statement_timeout', %s, true)", [f"{int(timeout_s * 1000)}"])
            cur.execute(query, prepare=True)
            if cur.description is None:
                return {"columns": [], "rows": [], "truncated": False}
            rows = cur.fetchmany(max_rows + 1)
            columns = [d.name for d in cur.description]
        conn.rollback()
    return {"columns": columns, "rows": [[_cell(v) for v in r] for r in rows[:max_rows]],
            "truncated": len(rows) > max_rows}


@router.post("/sql", response_model=SqlResult, responses=errors(400, 422))
@needs("read")
def sql(body: SqlRequest, config: Config) -> dict:
    """Run one read-only statement; 400 with Postgres's message for a bad query or a timeout."""
    if FORBIDDEN.search(body.query):
        raise ApiError(400, "statements that change roles or settings are not allowed here", field="query")
    max_rows = min(body.max_rows or config.sql_max_rows, config.sql_max_rows)
    dsn = _dsn(config.sql_database_url or config.database_url)
    try:
        return run_readonly(dsn, body.query, config.sql_timeout_s, max_rows, config.sql_database_url is None)
    except psycopg.errors.QueryCanceled as e:
        raise ApiError(400, f"query exceeded the {config.sql_timeout_s:g}s statement timeout", field="query",
                       hint="add a WHERE on run_id or a LIMIT; the views in docs/sql.md are indexed by run") from e
    except (psycopg.Error, ValueError) as e:
        reason = str(e).strip().splitlines()[0] if str(e).strip() else repr(e)
        raise ApiError(400, f"query failed: {reason}", field="query") from e
