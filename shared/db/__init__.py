"""Postgres: models (the schema) and engine/session factories."""
