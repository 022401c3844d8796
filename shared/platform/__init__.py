"""How a service runs: the Redis bus, the service runtime, settings, logs, retry, the db session and
migrations, heartbeats and leases."""
