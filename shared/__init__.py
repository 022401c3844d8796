"""What two or more services (or users) import, one folder per concern: `sdk/`, `contracts/` (imports nothing
of `platform/` nor of any service), `platform/`, `clients/`, `stores/`, `weights/`, `tasks/`.

Imports without torch: nothing heavy lives here at module level.

More: docs/architecture.md#shared-code
"""
