"""The Postgres schema (models.py) and which service writes each table (owners.py)."""
