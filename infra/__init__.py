"""Deployment: Dockerfiles, compose config and the local process stack."""
