"""Run alembic programmatically (the local stack, the migrate container and tests all use this)."""

from __future__ import annotations

from pathlib import Path

from alembic import command
from alembic.config import Config

MIGRATIONS_DIR = Path(__file__).resolve().parents[3] / "migrations"


def alembic_config(database_url: str) -> Config:
    cfg = Config()
    cfg.set_main_option("script_location", str(MIGRATIONS_DIR))
    cfg.set_main_option("sqlalchemy.url", database_url.replace("%", "%%"))
    return cfg


def upgrade(database_url: str, revision: str = "head") -> None:
    command.upgrade(alembic_config(database_url), revision)


def downgrade(database_url: str, revision: str = "base") -> None:
    command.downgrade(alembic_config(database_url), revision)


def main() -> None:
    """`python -m shared.platform.db.migrate [upgrade|downgrade] [revision]` with DATABASE_URL from the environment."""
    import sys

    from shared.platform.settings import ServiceSettings

    url = ServiceSettings().database_url
    action = sys.argv[1] if len(sys.argv) > 1 else "upgrade"
    rev = sys.argv[2] if len(sys.argv) > 2 else ("head" if action == "upgrade" else "base")
    (upgrade if action == "upgrade" else downgrade)(url, rev)


if __name__ == "__main__":
    main()
