"""Run controller: owns run lifecycles, dispatches rollout tasks with backpressure and a staleness window,
stores trajectories (group "store"), reconciles lost work from the Postgres ledger."""
