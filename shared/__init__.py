"""Contracts every service speaks: settings, run configs, data types, the agent/env API, stream messages,
the Redis streams bus and the Postgres schema. Imports without torch: nothing heavy lives here at module level."""
