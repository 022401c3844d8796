"""Engine and session factories. Services build one engine in `main`; nothing connects at import."""

from __future__ import annotations

import psycopg
from sqlalchemy import Engine, create_engine
from sqlalchemy.exc import DisconnectionError, InterfaceError, OperationalError
from sqlalchemy.orm import sessionmaker

# Postgres unreachable or the connection dropped (restart, failover, network): wait and retry, never treat
# the work at hand as bad. SQLAlchemy wraps driver errors; code on a raw psycopg cursor sees them unwrapped.
DB_DOWN = (OperationalError, InterfaceError, DisconnectionError, psycopg.OperationalError, psycopg.InterfaceError)


def make_engine(url: str, **kw) -> Engine:
    return create_engine(url, pool_pre_ping=True, future=True, **kw)


def session_factory(engine: Engine) -> sessionmaker:
    return sessionmaker(engine, expire_on_commit=False)
