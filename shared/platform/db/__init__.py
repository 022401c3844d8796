"""Postgres engines and sessions (session.py) and schema migrations (migrate.py); the schema is
shared.contracts.db.models."""
