"""Built-in agents and workflows (registered by name in shared.contracts.registry)."""
