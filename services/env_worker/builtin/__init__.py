"""Built-in envs, tools and rewards (registered by name in shared.contracts.registry). Importing this package
imports nothing heavy; each module pulls in its own libraries."""
