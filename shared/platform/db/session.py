"""Engine and session factories. Services build one engine in `main`; nothing connects at import."""

from __future__ import annotations

import psycopg
from sqlalchemy import Engine, create_engine
from sqlalchemy.exc import DisconnectionError, InterfaceError, OperationalError
from sqlalchemy.orm import sessionmaker

# Postgres unreachable or the connection dropped (restart, failover, network): wait and retry, never treat
# the work at hand as bad. SQLAlchemy wraps driver errors; code on a raw psycopg cursor sees them unwrapped.
DB_DOWN = (OperationalError, InterfaceError, DisconnectionError, psycopg.OperationalError, psycopg.InterfaceError)


# A database host cut off by the network answers nothing (no refusal): without these, a connect waited out the
# kernel's SYN retries (minutes) and a query on an open connection its retransmissions (~15 min), and the loop
# that made it hung that long. With them both fail within 30 s as OperationalError, which callers retry. libpq
# ignores the TCP ones on a unix socket.
POSTGRES_TCP_ARGS = {"connect_timeout": 10, "keepalives": 1, "keepalives_idle": 10, "keepalives_interval": 5,
                     "keepalives_count": 3, "tcp_user_timeout": 30_000}


def make_engine(url: str, **kw) -> Engine:
    if str(url).startswith("postgresql"):
        kw["connect_args"] = {**POSTGRES_TCP_ARGS, **kw.get("connect_args", {})}
    return create_engine(url, pool_pre_ping=True, future=True, **kw)


def session_factory(engine: Engine) -> sessionmaker:
    return sessionmaker(engine, expire_on_commit=False)
