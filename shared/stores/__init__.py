"""Postgres stores that more than one service reads and writes: datasets (the API and the jobs service)."""
