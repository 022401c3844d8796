"""Built-in agents, environments, rewards, tools, workflows and dataset generators (registered by name in
shared.contracts.registry). Importing this package imports nothing heavy; each module pulls in its own libraries."""
