"""What two or more services (or users) import, one folder per concern:

- `sdk/`: the user SDK (BaseAgent, BaseEnv, Workflow and their data types);
- `contracts/`: what services agree on: stream messages, stream and key names, the registry, the run config,
  the Postgres schema and who owns each table; imports nothing of `platform/` nor of any service;
- `platform/`: how a service runs: the Redis bus, service runtime, settings, logs, retry, db session, heartbeats,
  leases;
- `clients/`: what one service uses to ask another (run commands, jobs); `stores/`: Postgres stores two services
  share (datasets); `weights/`: the checkpoint format (manifest, fetch, deltas, delta kernels); `tasks/`: the
  built-in tasks' data that envs, dataset generators and test models agree on.
Imports without torch: nothing heavy lives here at module level."""
