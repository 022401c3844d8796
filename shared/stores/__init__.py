"""Stores that more than one service reads and writes: datasets in Postgres (the API and the jobs service),
Tinker usage in Redis (the trainer and the rollout workers count, the API reports)."""
