"""Celery worker for discrete background jobs: dataset import, checkpoint evaluation, parquet export, GC."""
