"""Sandbox mode `container`: one container per env session, from an image the env names, through the Docker
SDK on Docker or on podman's Docker-compatible socket (DOCKER_HOST), taken from a warm pool (`ContainerPool`).

Each container: no network, CPU / memory / pids limits, a read-only root plus size-capped tmpfs, capabilities
dropped but those the runner needs, no-new-privileges, the engine's seccomp profile plus seccomp.py's filter.
The program runs as uid 65534 under a runner it cannot signal or trace. A container that dies, an engine that
does not answer, or a runner that returns no result is an infrastructure failure (SandboxInfraError), never a
program failure.

More: docs/security.md#containers
"""

from __future__ import annotations

import atexit
import base64
import concurrent.futures
import json
import os
import queue
import socket
import threading
import time
from dataclasses import dataclass

from services.env_worker.sandbox.ns import SandboxInfraError, SandboxUnavailable
from services.env_worker.sandbox.seccomp import bpf_program
from shared.platform.logs import get_logger

log = get_logger(__name__)

LABEL = "flywheel.sandbox"  # "<hostname>:<pid>" of the process that made the container
PIDNS_LABEL = "flywheel.sandbox.pidns"  # that process's pid namespace: pids are compared only within one
WORK = "/work"
MAX_FILES_BYTES = 96 << 10  # files travel in the exec's argv (one argument is at most 128 KiB on Linux)

RUNNER = r"""
import base64, json, os, resource, signal, subprocess, sys, time
cfg = json.loads(sys.argv[1])
os.chdir(cfg["work"])
for name, data in cfg["files"].items():
    with open(name, "wb") as f:
        f.write(base64.b64decode(data))
import ctypes
bpf = base64.b64decode(cfg["seccomp"])
class Fprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]
filter_buf = ctypes.create_string_buffer(bpf, len(bpf))
fprog = Fprog(len(bpf) // 8, ctypes.addressof(filter_buf))
libc = ctypes.CDLL(None, use_errno=True)
def limits():  # in the child, after the switch to uid 65534, before exec
    for kind, value in ((resource.RLIMIT_CPU, cfg["cpu_s"]), (resource.RLIMIT_AS, cfg["memory_bytes"]),
                        (resource.RLIMIT_FSIZE, cfg["file_bytes"]), (resource.RLIMIT_CORE, 0)):
        resource.setrlimit(kind, (value, value))
    if libc.prctl(38, 1, 0, 0, 0) != 0 or libc.prctl(22, 2, ctypes.byref(fprog), 0, 0) != 0:
        os._exit(125)  # PR_SET_NO_NEW_PRIVS, PR_SET_SECCOMP: no program runs without the filter
out, err = open("/tmp/.fw-out", "w+b"), open("/tmp/.fw-err", "w+b")
os.chmod("/tmp/.fw-out", 0o600); os.chmod("/tmp/.fw-err", 0o600)
start = time.monotonic()
proc = subprocess.Popen([cfg["python"], "-I", "main.py"], stdin=subprocess.PIPE, stdout=out, stderr=err,
                        user=65534, group=65534, extra_groups=[], preexec_fn=limits, start_new_session=True,
                        env={"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": cfg["work"], "LANG": "C.UTF-8",
                             "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"})
try:
    proc.communicate(cfg["stdin"].encode(), timeout=cfg["wall_s"])
    timed_out = False
except subprocess.TimeoutExpired:
    timed_out = True
try:
    os.killpg(proc.pid, signal.SIGKILL)
except OSError:
    pass
proc.wait()
for _ in range(100):  # whatever the program left running: every process of its uid
    pids = [int(p) for p in os.listdir("/proc") if p.isdigit() and os.stat("/proc/" + p).st_uid == 65534]
    if not pids:
        break
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
    time.sleep(0.01)
cap = cfg["output_bytes"]
res = {"exit_code": None if timed_out else proc.returncode, "timed_out": timed_out,
       "duration_s": time.monotonic() - start}
for key, f in (("stdout", out), ("stderr", err)):
    f.seek(0)
    data = f.read(cap + 1)
    res[key], res[key + "_truncated"] = data[:cap].decode(errors="replace"), len(data) > cap
print("\n" + json.dumps(res))
"""


def _seccomp_b64() -> str:
    return base64.b64encode(bpf_program()).decode()  # the namespaces mode's filter (cached), on the program


def client(timeout_s: float = 60):
    """A Docker SDK client for DOCKER_HOST (podman's socket works: unix:///run/podman/podman.sock)."""
    import docker

    try:
        c = docker.DockerClient(base_url=os.environ.get("DOCKER_HOST") or "unix:///var/run/docker.sock",
                                timeout=int(timeout_s))
        c.ping()
        return c
    except Exception as e:  # docker.errors.DockerException and connection errors
        raise SandboxUnavailable(f"sandbox mode 'container' needs a Docker-compatible engine at DOCKER_HOST "
                                 f"({os.environ.get('DOCKER_HOST') or 'unset: /var/run/docker.sock'}): {e}. "
                                 "infra/compose/podman-host.sh service starts podman's") from None


def check_image(image: str) -> None:
    """SandboxUnavailable unless the engine answers and has `image` locally (nothing is pulled)."""
    import docker

    try:
        client().images.get(image)
    except docker.errors.ImageNotFound:
        raise SandboxUnavailable(f"sandbox image {image!r} is not on this engine: build it first "
                                 "(make sandbox-image builds localhost/flywheel-sandbox-python:local)") from None


@dataclass(frozen=True)
class ContainerSpec:
    image: str
    memory_bytes: int = 1 << 30
    cpus: float = 1.0
    max_procs: int = 64
    disk_bytes: int = 64 << 20
    python: str = "python3"  # the image's interpreter, by name on its PATH or absolute
    grace_s: float = 15.0  # an exec that has not answered wall_s + grace_s after it started: the container hung


# PID 1 of each container: reaps the processes a program orphans (killed ones too), so none stays a zombie
# holding a slot of the pids limit.
REAPER = "import os, time\nwhile True:\n    try:\n        os.wait()\n    except ChildProcessError:\n        time.sleep(0.2)"


def _create(c, spec: ContainerSpec):
    size = f"size={spec.disk_bytes},mode=1777"
    return c.containers.run(
        spec.image, [spec.python, "-c", REAPER], detach=True, network_mode="none", read_only=True,
        tmpfs={WORK: size, "/tmp": size}, mem_limit=spec.memory_bytes, memswap_limit=spec.memory_bytes,
        nano_cpus=int(spec.cpus * 1e9), pids_limit=spec.max_procs, user="0:0", cap_drop=["ALL"],
        cap_add=["SETUID", "SETGID", "KILL"], security_opt=["no-new-privileges"], working_dir=WORK,
        labels={LABEL: f"{socket.gethostname()}:{os.getpid()}", PIDNS_LABEL: _pid_namespace()}, init=False)


def _pid_namespace() -> str:
    return str(os.stat("/proc/self/ns/pid").st_ino)


def sweep_leftovers(engine) -> list[str]:
    """Removes the containers a dead env worker left (a SIGKILL or an OOM kill skips atexit): those labelled with
    this host and pid namespace whose pid no longer runs, or is this process's own (a worker restarted in a
    container is pid 1 again). Called once per process before its first pool makes any container, so none of
    its own is swept. Returns the names removed."""
    host, pidns, removed = socket.gethostname(), _pid_namespace(), []
    for c in engine.containers.list(all=True, filters={"label": LABEL}):
        owner, _, pid = c.labels.get(LABEL, "").rpartition(":")
        if owner != host or c.labels.get(PIDNS_LABEL) != pidns or not pid.isdigit():
            continue  # another machine's or another namespace's: its pid means nothing here
        if int(pid) != os.getpid() and _running(int(pid)):
            continue
        try:
            c.remove(force=True)
            removed.append(c.name)
        except Exception:  # removed meanwhile by its owner or another sweep
            continue
    return removed


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


class ContainerSession:
    """One env session's container. `run_python` may be called many times (the work dir persists between them)."""

    def __init__(self, container, spec: ContainerSpec, on_close=None):
        self.container, self.spec, self._on_close = container, spec, on_close

    def run_python(self, code: str, *, stdin: str = "", files: dict[str, str] | None = None, limits=None):
        from services.env_worker.sandbox import SandboxLimits, SandboxResult

        limits = limits or SandboxLimits()
        payload = {name: base64.b64encode(text.encode()).decode()
                   for name, text in {**(files or {}), "main.py": code}.items()}
        if sum(map(len, payload.values())) > MAX_FILES_BYTES:
            raise ValueError(f"container sandbox: code and files exceed {MAX_FILES_BYTES} bytes (base64)")
        cfg = {"work": WORK, "files": payload, "stdin": stdin, "seccomp": _seccomp_b64(), "python": self.spec.python, "wall_s": limits.wall_s,
               "cpu_s": limits.cpu_s, "memory_bytes": limits.memory_bytes, "file_bytes": limits.file_bytes,
               "output_bytes": limits.output_bytes}
        start = time.monotonic()
        argv = [self.spec.python, "-I", "-c", RUNNER, json.dumps(cfg)]
        call = _EXECS.submit(self.container.exec_run, argv, user="0", workdir=WORK)
        try:
            code_, output = call.result(timeout=limits.wall_s + self.spec.grace_s)
            last = output.decode(errors="replace").rstrip().rpartition("\n")[2] if output else ""
            res = json.loads(last)
        except concurrent.futures.TimeoutError:
            self.close()  # the session is over: nothing of a hung or dead container is kept
            raise SandboxInfraError(f"container {self.container.short_id} hung: no answer {limits.wall_s}s + "
                                    f"{self.spec.grace_s}s after the program started") from None
        except ValueError:
            self.close()
            raise SandboxInfraError(f"container {self.container.short_id}: the runner returned no result "
                                    f"(exit {code_}): {output[-500:]!r}") from None
        except Exception as e:  # the engine's socket failed, the container is gone, ...
            self.close()
            raise SandboxInfraError(f"container {self.container.short_id}: exec failed: {e}") from e
        return SandboxResult(res["stdout"], res["stderr"], res["exit_code"], res["timed_out"],
                             res["stdout_truncated"] or res["stderr_truncated"], time.monotonic() - start,
                             "container")

    def close(self) -> None:
        try:
            self.container.remove(force=True)
        except Exception:
            pass  # already gone; a worker killed before this ran leaves it to the next worker's sweep_leftovers
        if self._on_close:
            self._on_close()


class ContainerPool:
    """Started containers kept ready per spec, so a session does not wait for container creation. `acquire`
    takes one (or creates one when the pool is empty) and a background thread tops the pool back up."""

    def __init__(self, spec: ContainerSpec, size: int = 2, engine=None):
        self.spec, self.size = spec, size
        self.engine = engine or client()
        self.ready: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._filling = 0
        self._closed = False
        self.refill()

    def acquire(self) -> ContainerSession:
        try:
            container = self.ready.get_nowait()
        except queue.Empty:
            container = self._make()
        self.refill()
        return ContainerSession(container, self.spec)

    def _make(self):
        try:
            return _create(self.engine, self.spec)
        except Exception as e:
            raise SandboxInfraError(f"could not start a container from {self.spec.image!r}: {e}") from e

    def refill(self) -> None:
        with self._lock:
            missing = self.size - self.ready.qsize() - self._filling
            self._filling += max(0, missing)
        for _ in range(max(0, missing)):
            threading.Thread(target=self._fill_one, daemon=True).start()

    def _fill_one(self) -> None:
        try:
            container = self._make()
            if self._closed:
                container.remove(force=True)
            else:
                self.ready.put(container)
        except Exception:
            pass  # the next acquire creates one itself and reports why if it cannot
        finally:
            with self._lock:
                self._filling -= 1

    def close(self) -> None:
        self._closed = True
        while True:
            try:
                self.ready.get_nowait().remove(force=True)
            except queue.Empty:
                return
            except Exception:
                continue


_EXECS = concurrent.futures.ThreadPoolExecutor(64, thread_name_prefix="sandbox-exec")  # a hung exec holds one
_POOLS: dict[ContainerSpec, ContainerPool] = {}
_POOLS_LOCK = threading.Lock()


def pool_for(spec: ContainerSpec, size: int | None = None) -> ContainerPool:
    """The process-wide warm pool of `spec` (SANDBOX_POOL_SIZE containers, default 2). The first one of the
    process sweeps the leftovers of dead workers first."""
    with _POOLS_LOCK:
        if spec not in _POOLS:
            check_image(spec.image)
            if not _POOLS:
                for name in sweep_leftovers(client()):
                    log.info("removed container %s, left by a worker that is gone", name)
            _POOLS[spec] = ContainerPool(spec, size if size is not None else int(os.environ.get("SANDBOX_POOL_SIZE",
                                                                                                   "2")))
        return _POOLS[spec]


@atexit.register
def _close_pools() -> None:
    """The warm containers go with the process (a killed worker's are removed by the next one's sweep_leftovers)."""
    for pool in list(_POOLS.values()):
        pool.close()
