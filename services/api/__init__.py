"""The REST API: runs, trajectories, datasets, jobs, tokens, SQL; auth; Prometheus metrics; the dashboard."""
