"""Sandbox mode `container` on a real engine (podman's Docker API here): `make test-container` sets podman and the
image up (DOCKER_HOST, SANDBOX_IMAGE) and runs these; `make test` leaves them out (marker `container`)."""

import os
import threading
import time
import uuid

import pytest

from services.env_worker.sandbox import SandboxLimits, run_python
from services.env_worker.sandbox import container as sc
from services.env_worker.sessions import SessionHost
from shared.contracts.messages import EnvRequest
from shared.contracts.registry import resolve
from tests.support.sandbox_escapes import ESCAPES, Target

IMAGE = os.environ.get("SANDBOX_IMAGE", "localhost/flywheel-sandbox-python:local")


def _engine_missing() -> str | None:
    if os.environ.get("SANDBOX_REQUIRE_CONTAINER") == "1":  # make test-container: a missing engine is a failure
        return None
    try:
        sc.check_image(IMAGE)
    except Exception as e:
        return str(e)
    return None


pytestmark = [pytest.mark.container,
              pytest.mark.skipif(bool(_engine_missing()), reason="no engine or sandbox image: make test-container")]
LIMITS = SandboxLimits(wall_s=5, cpu_s=3, memory_bytes=512 << 20, output_bytes=4096, max_procs=32,
                       disk_bytes=32 << 20)


def ours() -> list:
    return sc.client().containers.list(all=True, filters={"label": f"{sc.LABEL}"})


@pytest.fixture(scope="module")
def target():
    with Target(image=IMAGE) as t:
        yield t


@pytest.mark.parametrize("escape", ESCAPES, ids=lambda e: e.name)
def test_container_contains_it(target, escape):
    outcome = target.attempt(escape, "container")
    assert outcome.contained, f"{escape.name}: {outcome.evidence}\n{outcome.result.stdout[-500:]}"


def test_container_limits_and_view():
    code = ("import os, socket\nprint(os.getuid(), os.getcwd(), sorted(os.environ))\n"
            "print(len(open('/proc/net/dev').read().splitlines()) - 2)\n"
            "try:\n    open('/usr/x', 'w')\nexcept OSError as e:\n    print('ro', e.errno)\n")
    result = run_python(code, limits=LIMITS, mode="container", image=IMAGE)
    assert result.ok, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0].startswith("65534 /work ['HOME', 'LANG', 'MKL_NUM_THREADS'") and "SANDBOX" not in lines[0]
    assert lines[1] == "1" and lines[2] == "ro 30"  # loopback only; read-only root


def test_python_tool_runs_in_a_container():
    tool = resolve("env", "tool").from_dict({"question": "q", "ground_truth": "1", "sandbox": "container",
                                             "image": IMAGE}).tools["python"]
    assert tool(code="import os\nprint(os.getuid(), os.getcwd())").strip() == "65534 /work"


def test_worker_start_check_passes_with_an_engine():
    from services.env_worker.main import check_sandbox
    from services.env_worker.settings import EnvWorkerSettings

    check_sandbox(EnvWorkerSettings(sandbox_modes="namespaces,container"))


def test_pool_hands_out_started_containers_fast_and_removes_them_after():
    pool = sc.ContainerPool(sc.ContainerSpec(IMAGE, memory_bytes=LIMITS.memory_bytes), size=1)
    try:
        deadline = time.monotonic() + 60
        while pool.ready.qsize() < 1 and time.monotonic() < deadline:
            time.sleep(0.1)
        start = time.perf_counter()
        session = pool.acquire()
        assert time.perf_counter() - start < 0.1  # warm: no container creation on the session's path
        assert session.run_python("print(6 * 7)", limits=LIMITS).stdout == "42\n"
        name = session.container.name
        session.close()
        assert name not in {c.name for c in ours()}
    finally:
        pool.close()


def test_code_env_grades_in_a_container_end_to_end():
    env_cls = resolve("env", "code")
    task = {"tests": "assert add(2, 3) == 5", "sandbox": "container", "image": IMAGE}
    env = env_cls.from_dict(task)
    env.reset()
    _, reward, done, info = env.step("```python\ndef add(a, b):\n    return a + b\n```")
    assert (reward, done, info["sandbox"]) == (1.0, True, "container")
    name = env.container.container.name
    env.close()
    assert name not in {c.name for c in ours()}
    env = env_cls.from_dict(task)
    env.reset()
    assert env.step("```python\ndef add(a, b):\n    return a - b\n```")[1] == 0.0
    env.close()


async def test_a_container_that_dies_is_an_infra_failure_not_a_score():
    """Through the env worker's SessionHost: the container is killed under a live session; the step's reply is
    error_kind `infra` (the rollout worker ends the trajectory as infra_error, never scored)."""
    host = SessionHost("w-test", threads=2, max_sessions=10)
    sid = uuid.uuid4().hex

    def req(op, **kw):
        return EnvRequest(request_id=uuid.uuid4().hex, op=op, session_id=sid, run_id="r", env="code",
                          env_args={"sandbox": "container", "image": IMAGE, "max_turns": 3}, reply_to="x",
                          timeout_s=60, sent_at=time.time(), **kw)

    try:
        assert (await host.handle(req("reset", task={"tests": "assert f() == 1"}))).ok
        reply = await host.handle(req("step", action="```python\ndef f():\n    return 2\n```"))
        assert reply.ok and reply.reward == 0.0 and not reply.done
        container = host.sessions[sid].env.container.container
        container.kill()
        reply = await host.handle(req("step", action="```python\ndef f():\n    return 1\n```"))
        assert not reply.ok and reply.error_kind == "infra" and "sandbox failure" in reply.error
        assert container.name not in {c.name for c in ours()}  # a dead container is removed, not kept
    finally:
        host.shutdown()


def test_a_hung_container_is_an_infra_failure():
    pool = sc.ContainerPool(sc.ContainerSpec(IMAGE, memory_bytes=LIMITS.memory_bytes, grace_s=2), size=0)
    session = pool.acquire()
    freezer = threading.Timer(1.0, session.container.pause)  # frozen while the program runs: exec never answers
    try:
        start = time.monotonic()
        freezer.start()
        with pytest.raises(sc.SandboxInfraError, match="hung"):
            session.run_python("import time\ntime.sleep(1.5)", limits=SandboxLimits(wall_s=2))
        assert time.monotonic() - start < 10
        assert session.container.name not in {c.name for c in ours()}  # removed, frozen or not
    finally:
        freezer.join()
        session.close()


def test_a_killed_workers_containers_are_swept_and_a_live_ones_kept():
    """sweep_leftovers (run by a worker's first pool) removes the containers of a SIGKILLed worker (no atexit ran),
    and keeps those of a worker still running on this host."""
    import signal
    import subprocess
    import sys

    make = ("import sys, time\nfrom services.env_worker.sandbox import container as sc\n"
            f"c = sc._create(sc.client(), sc.ContainerSpec({IMAGE!r}))\nprint(c.name, flush=True)\ntime.sleep(600)\n")
    workers = [subprocess.Popen([sys.executable, "-c", make], stdout=subprocess.PIPE, text=True) for _ in range(2)]
    dead, names = workers[0], []
    try:
        names = [w.stdout.readline().strip() for w in workers]
        assert all(names), names
        dead.send_signal(signal.SIGKILL)
        dead.wait(10)
        removed = sc.sweep_leftovers(sc.client())
        assert names[0] in removed and names[1] not in removed, (names, removed)
        left = {c.name for c in ours()}
        assert names[0] not in left and names[1] in left
    finally:
        for w in workers:
            w.kill()
            w.wait(10)
        for c in ours():
            if c.name in names:
                c.remove(force=True)
