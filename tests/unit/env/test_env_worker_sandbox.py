"""The env worker refuses to start when a sandbox mode it must give cannot run here (no silent fall back)."""

import os
import subprocess
import sys

import pytest

from services.env_worker.config import EnvWorkerConfig
from services.env_worker.main import check_sandbox


def test_default_mode_is_checked_and_available_here():
    check_sandbox(EnvWorkerConfig())  # namespaces: bubblewrap really runs a probe sandbox


def test_unknown_or_unavailable_mode_stops_the_worker_with_the_reason(tmp_path, monkeypatch):
    with pytest.raises(SystemExit, match="unknown sandbox mode 'gvisor'"):
        check_sandbox(EnvWorkerConfig(sandbox_modes="namespaces,gvisor"))
    monkeypatch.setenv("DOCKER_HOST", f"unix://{tmp_path}/no-engine.sock")
    with pytest.raises(SystemExit, match="'container' needs a Docker-compatible engine"):
        check_sandbox(EnvWorkerConfig(sandbox_modes="container"))


def test_a_worker_without_bubblewrap_exits_at_start_saying_so(tmp_path):
    """A real env-worker process whose PATH has no bwrap: exit status non-zero, the reason on stderr."""
    env = {**os.environ, "PATH": str(tmp_path), "REDIS_URL": os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0"),
           "HEALTH_PORT": "0"}
    proc = subprocess.run([sys.executable, "-m", "services.env_worker.main"], env=env, capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode != 0
    assert "apt-get install bubblewrap" in proc.stderr + proc.stdout
