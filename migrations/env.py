"""Alembic environment: the URL comes from the caller's config or from DATABASE_URL (same settings as the
services), the target metadata from shared.contracts.db.models."""

from alembic import context
from sqlalchemy import create_engine

from shared.contracts.db.models import Base
from shared.platform.settings import ServiceSettings

config = context.config


def _url() -> str:
    return config.get_main_option("sqlalchemy.url") or ServiceSettings().database_url


def run_migrations_online() -> None:
    engine = create_engine(_url())
    with engine.connect() as connection:
        context.configure(connection=connection, target_metadata=Base.metadata, compare_type=True)
        with context.begin_transaction():
            context.run_migrations()
    engine.dispose()


def run_migrations_offline() -> None:
    context.configure(url=_url(), target_metadata=Base.metadata, literal_binds=True)
    with context.begin_transaction():
        context.run_migrations()


if context.is_offline_mode():
    run_migrations_offline()
else:
    run_migrations_online()
