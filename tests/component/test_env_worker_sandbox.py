"""The env worker refuses to start when a sandbox mode it must give cannot run here (no silent fall back)."""

import os
import subprocess
import sys

import pytest

from services.env_worker.main import check_sandbox
from services.env_worker.sandbox import ns as sandbox_ns
from services.env_worker.settings import EnvWorkerSettings


def test_default_mode_is_checked_and_available_here():
    check_sandbox(EnvWorkerSettings())  # namespaces: bubblewrap really runs a probe sandbox


def test_unknown_or_unavailable_mode_stops_the_worker_with_the_reason(tmp_path, monkeypatch):
    with pytest.raises(SystemExit, match="unknown sandbox mode 'gvisor'"):
        check_sandbox(EnvWorkerSettings(sandbox_modes="namespaces,gvisor"))
    monkeypatch.setenv("DOCKER_HOST", f"unix://{tmp_path}/no-engine.sock")
    with pytest.raises(SystemExit, match="'container' needs a Docker-compatible engine"):
        check_sandbox(EnvWorkerSettings(sandbox_modes="container"))


def test_a_worker_without_bubblewrap_exits_at_start_saying_so(tmp_path):
    """A real env-worker process whose PATH has no bwrap: exit status non-zero, the reason on stderr."""
    env = {**os.environ, "PATH": str(tmp_path), "REDIS_URL": os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0"),
           "HEALTH_PORT": "0"}
    proc = subprocess.run([sys.executable, "-m", "services.env_worker.main"], env=env, capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode != 0
    assert "apt-get install bubblewrap" in proc.stderr + proc.stdout


def test_a_host_that_refuses_the_sandbox_is_told_what_to_change_for_each_engine(monkeypatch):
    monkeypatch.setattr(sandbox_ns, "_probe", lambda lay: "bwrap exited with 1: bwrap: No permissions to create "
                        "new namespace, likely because the kernel does not allow non-privileged user namespaces")
    sandbox_ns.layout.cache_clear()
    try:
        with pytest.raises(SystemExit) as stopped:
            check_sandbox(EnvWorkerSettings())
    finally:
        sandbox_ns.layout.cache_clear()
    message = str(stopped.value)
    assert "No permissions to create new namespace" in message
    for fix in ("user.max_user_namespaces", "Docker: `docker run --security-opt seccomp=unconfined",
                "Podman: `podman run --security-opt seccomp=unconfined", "Kubernetes:",
                "seccompProfile: {type: Unconfined}", "SANDBOX_MODES=container"):
        assert fix in message, fix


async def test_a_sandbox_the_worker_cannot_give_is_an_infra_failure_not_a_user_error(tmp_path, monkeypatch):
    """A code env asking for a container sandbox on a worker with no engine (or without the image) at session
    time: the reply is error_kind `infra` with the reason, so the unit is never scored nor blamed on the user."""
    import time
    import uuid

    from services.env_worker.sessions import SessionHost
    from shared.contracts.messages import EnvRequest

    monkeypatch.setenv("DOCKER_HOST", f"unix://{tmp_path}/no-engine.sock")
    host, sid = SessionHost("w-test", threads=1, max_sessions=4), uuid.uuid4().hex

    def req(op, **kw):
        return EnvRequest(request_id=uuid.uuid4().hex, op=op, session_id=sid, run_id="r", env="code",
                          env_args={"sandbox": "container", "image": "localhost/no-such-image:1"}, reply_to="x",
                          timeout_s=60, sent_at=time.time(), **kw)

    try:
        assert (await host.handle(req("reset", task={"tests": "assert f() == 1"}))).ok
        reply = await host.handle(req("step", action="```python\ndef f():\n    return 1\n```"))
        assert not reply.ok and reply.error_kind == "infra", reply
        assert "sandbox unavailable on w-test" in reply.error and "Docker-compatible engine" in reply.error
        assert sid not in host.sessions
    finally:
        host.shutdown()
