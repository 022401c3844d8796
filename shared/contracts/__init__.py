"""What the services agree on. Imports nothing of shared.platform nor of any service (no sandbox, docker or
seccomp either): tests/contract/test_layering.py checks it."""
