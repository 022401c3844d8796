"""Sandbox mode `namespaces`: each execution in its own bubblewrap sandbox (Debian package `bubblewrap`).

The program gets new user, mount, PID, network (loopback only), IPC, UTS namespaces; uid 65534 with no
capabilities and no_new_privs; a read-only root of only /usr and the Python installation; size-capped tmpfs
for `/sandbox` and `/tmp`; an empty environment; seccomp.py's filter; rlimits with soft = hard. Nothing else
of the worker exists in there. When the sandbox's first process exits or bwrap is killed, the kernel kills
every process left in its PID namespace. A root worker runs bwrap as uid 65534 where it can, else bounds
processes and memory with cgroups.

More: docs/security.md#namespaces
"""

from __future__ import annotations

import functools
import json
import os
import select
import shutil
import site
import stat
import subprocess
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path

from services.env_worker.sandbox.seccomp import bpf_program

BOOT = Path(__file__).with_name("boot.py")
SANDBOX_UID = 65534  # "nobody" inside the sandbox and, when the worker is root, outside it too
WORK, TMP = "/sandbox", "/tmp"
SYSTEM_LINKS = ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")


class SandboxUnavailable(RuntimeError):
    """The mode asked for cannot run here; the message says why and what to change."""


class SandboxInfraError(RuntimeError):
    """The sandbox itself failed (container died or hung, engine unreachable): not the program's fault."""


@dataclass(frozen=True)
class Layout:
    bwrap: str
    interpreter: str  # the real Python binary (a venv's bin/python is a symlink to it)
    ro_binds: tuple[str, ...]  # host paths shown read-only at the same place
    links: tuple[tuple[str, str], ...]  # merged-/usr symlinks (/lib -> usr/lib), recreated as they are
    site_packages: tuple[str, ...]
    host_uid: int | None  # uid bwrap runs as; None: the worker's own
    cgroups: tuple[tuple[str, str], ...]  # (controller, parent) for per-sandbox cgroups (root workers), else ()
    proc: bool  # a fresh /proc (some container runtimes mask /proc so that none can be mounted)
    userns_sysctl: bool  # bwrap --disable-userns (needs a writable /proc/sys); the seccomp filter refuses them anyway


def _python_paths() -> tuple[str, list[str], list[str]]:
    interpreter = os.path.realpath(sys.executable)
    roots = {os.path.realpath(p) for p in (sys.base_prefix, sys.base_exec_prefix)}
    sites = [os.path.realpath(p) for p in site.getsitepackages() if os.path.isdir(p)]
    return interpreter, sorted(roots), sites


def _covered(path: str, binds: list[str]) -> bool:
    return any(path == b or path.startswith(b + "/") for b in binds)


def _world_readable(path: str) -> bool:
    """Every directory above `path` searchable by others, `path` itself readable: what a non-root bwrap needs."""
    p = Path(path)
    for parent in [*reversed(p.parents), p]:
        mode = os.stat(parent).st_mode
        if not mode & stat.S_IXOTH or (parent == p and not mode & stat.S_IROTH):
            return False
    return True


def _layout(proc: bool = True, userns_sysctl: bool = True) -> Layout:
    bwrap = shutil.which("bwrap")
    if bwrap is None:
        raise SandboxUnavailable("sandbox mode 'namespaces' needs bubblewrap: apt-get install bubblewrap "
                                 "(`make install` does it when run as root)")
    interpreter, roots, sites = _python_paths()
    binds = ["/usr"]
    for path in [*roots, *sites, os.path.dirname(interpreter)]:
        if not _covered(path, binds):
            binds.append(path)
    links = []
    for path in SYSTEM_LINKS:
        if os.path.islink(path):
            links.append((os.readlink(path), path))
        elif os.path.isdir(path):
            binds.append(path)
    if os.path.exists("/etc/ld.so.cache"):
        binds.append("/etc/ld.so.cache")
    host_uid = None
    if os.geteuid() == 0:
        override = os.environ.get("SANDBOX_HOST_UID")
        if override is not None:
            host_uid = int(override)
        else:
            host_uid = SANDBOX_UID if all(_world_readable(b) for b in binds) else 0
    cgroups = _cgroup_parents() if os.geteuid() == 0 else {}
    if host_uid == 0:
        if "pids" not in cgroups:
            raise SandboxUnavailable(
                "sandbox mode 'namespaces' as root with a Python installation other users cannot read (bwrap then runs "
                "as host uid 0, to which the kernel does not apply RLIMIT_NPROC) needs a writable pids cgroup "
                "(/sys/fs/cgroup/pids or cgroup v2 with the pids controller) to limit processes; make the Python "
                f"installation ({', '.join(roots)}) readable by others, or run the worker as a non-root user")
    return Layout(bwrap, interpreter, tuple(binds), tuple(links), tuple(sites), host_uid, tuple(cgroups.items()),
                  proc, userns_sysctl)


def _cgroup_parents() -> dict[str, str]:
    """controller -> a writable parent cgroup for per-sandbox ones, for `pids` and `memory` where the worker may
    create cgroups (cgroup v1 hierarchies, or v2 with the controller enabled)."""
    found = {}
    for controller in ("pids", "memory"):
        for root in (f"/sys/fs/cgroup/{controller}", "/sys/fs/cgroup"):
            controllers = Path(root, "cgroup.controllers")
            v1 = root.endswith(f"/{controller}") and Path(root, "cgroup.procs").exists()
            if not (v1 or (controllers.exists() and controller in controllers.read_text().split())):
                continue
            parent = Path(root, "flywheel-sandbox")
            try:
                parent.mkdir(exist_ok=True)
                if not v1:
                    (parent / "cgroup.subtree_control").write_text(f"+{controller}")
                found[controller] = str(parent)
                break
            except OSError:
                continue
    return found


class _Cgroups:
    """One sandbox's cgroups: a process limit (what RLIMIT_NPROC cannot give for host uid 0) and, where the
    memory controller is there, a memory limit on the whole process tree (its tmpfs pages included)."""

    def __init__(self, parents: dict[str, str], max_procs: int, memory_bytes: int):
        name = f"s{os.getpid()}-{time.monotonic_ns()}"
        self.paths = list(dict.fromkeys(Path(parent, name) for parent in parents.values()))  # v2: one dir
        limits = {"pids.max": str(max_procs + 1),  # + bwrap's own PID 1
                  "memory.limit_in_bytes": str(memory_bytes), "memory.memsw.limit_in_bytes": str(memory_bytes),
                  "memory.max": str(memory_bytes), "memory.swap.max": "0"}
        for path in self.paths:
            path.mkdir()
            for file, value in limits.items():
                if (path / file).exists():
                    (path / file).write_text(value)

    @property
    def procs_files(self) -> list[str]:
        return [str(p / "cgroup.procs") for p in self.paths]

    def remove(self) -> None:
        for path in self.paths:
            delay, deadline = 0.0002, time.monotonic() + 1.0
            while True:  # the kernel reaps the namespace's processes just after its PID 1 exits (~1-10 ms)
                try:
                    path.rmdir()
                    break
                except FileNotFoundError:
                    break
                except OSError:
                    if time.monotonic() > deadline:
                        break
                    time.sleep(delay)
                    delay = min(2 * delay, 0.01)


def bwrap_argv(lay: Layout, cfg: dict, files: list[str], disk_bytes: int) -> list[str]:
    """The bwrap command line; `@fd:NAME` stands for a file descriptor `run` fills in."""
    argv = [
        lay.bwrap, "--unshare-user", "--unshare-pid", "--unshare-net", "--unshare-ipc", "--unshare-uts",
        "--unshare-cgroup-try", "--uid", str(SANDBOX_UID), "--gid", str(SANDBOX_UID), "--hostname", "sandbox",
        *(["--disable-userns"] if lay.userns_sysctl else []),
        "--cap-drop", "ALL", "--die-with-parent", "--new-session", "--clearenv",
        "--setenv", "PATH", "/usr/local/bin:/usr/bin:/bin", "--setenv", "HOME", WORK, "--setenv", "TMPDIR", TMP,
        "--setenv", "LANG", "C.UTF-8", "--setenv", "PYTHONHASHSEED", "0", "--setenv", "PYTHONDONTWRITEBYTECODE", "1",
        # BLAS/OpenMP start a thread per core at import: on a big host that alone would pass max_procs
        "--setenv", "OMP_NUM_THREADS", "1", "--setenv", "OPENBLAS_NUM_THREADS", "1", "--setenv", "MKL_NUM_THREADS", "1",
    ]
    # The tmpfs first: a host path under one of them (Python in /tmp) is then bound on top, not hidden.
    argv += ["--size", str(disk_bytes), "--tmpfs", TMP, "--size", str(disk_bytes), "--tmpfs", WORK]
    for path in lay.ro_binds:
        argv += ["--ro-bind", path, path]
    for target, path in lay.links:
        argv += ["--symlink", target, path]
    if lay.proc:
        argv += ["--proc", "/proc"]
    argv += ["--dev", "/dev", "--size", str(disk_bytes), "--tmpfs", "/dev/shm", "--remount-ro", "/dev",
             "--seccomp", "@fd:seccomp", "--ro-bind-data", "@fd:boot", "/.sandbox_boot.py"]
    for i, name in enumerate(files):
        argv += ["--file", f"@fd:file{i}", f"{WORK}/{name}"]
    argv += ["--chdir", WORK, lay.interpreter, "-I", "-S", "/.sandbox_boot.py",
             json.dumps({**cfg, "guard": "kernel", "site_packages": list(lay.site_packages)})]
    return argv


def _memfd(name: str, data: bytes) -> int:
    fd = os.memfd_create(name, 0)
    _write_all(fd, data)
    os.lseek(fd, 0, os.SEEK_SET)
    return fd


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


@dataclass
class Raw:
    stdout_fd: int
    stderr_fd: int
    exit_code: int | None
    timed_out: bool
    duration_s: float


def _exited_within(proc: subprocess.Popen, timeout_s: float) -> bool:
    """Whether `proc` exits within `timeout_s`, told the moment it does: a pidfd becomes readable then.
    (`Popen.wait(timeout)` polls with sleeps that grow to 50 ms: ~30 ms added to a short program's time.)"""
    try:
        fd = os.pidfd_open(proc.pid)
    except OSError:  # already reaped, or a kernel without pidfds (< 5.3): the polling wait
        try:
            proc.wait(timeout=timeout_s)
            return True
        except subprocess.TimeoutExpired:
            return False
    try:
        return bool(select.select([fd], [], [], timeout_s)[0])
    finally:
        os.close(fd)


def run(lay: Layout, files: dict[str, str], stdin: str, cfg: dict, wall_s: float, disk_bytes: int) -> Raw:
    """Run `main.py` (in `files`) in a fresh sandbox. The caller reads and closes the returned output fds."""
    names = list(files)
    fds = {"seccomp": _memfd("seccomp", bpf_program()), "boot": _memfd("boot", BOOT.read_bytes())}
    for i, name in enumerate(names):
        fds[f"file{i}"] = _memfd(name, files[name].encode())
    stdin_fd = _memfd("stdin", stdin.encode())
    out_fd, err_fd = os.memfd_create("stdout", 0), os.memfd_create("stderr", 0)
    argv = [str(fds[a[4:]]) if a.startswith("@fd:") else a for a in bwrap_argv(lay, cfg, names, disk_bytes)]
    cgroup = None
    if lay.cgroups:  # bwrap starts inside the cgroups: a shell moves itself in, then execs bwrap
        cgroup = _Cgroups(dict(lay.cgroups), int(cfg["max_procs"]), int(cfg["memory_bytes"]) + 3 * disk_bytes)
        enter = 'while [ "$1" != -- ]; do echo $$ > "$1" || exit 125; shift; done; shift; exec "$@"'
        argv = ["/bin/sh", "-c", enter, "sh", *cgroup.procs_files, "--", *argv]
    user = {} if lay.host_uid in (None, os.geteuid()) else {
        "user": lay.host_uid, "group": lay.host_uid, "extra_groups": []}
    start = time.monotonic()
    try:
        proc = subprocess.Popen(argv, stdin=stdin_fd, stdout=out_fd, stderr=err_fd, pass_fds=tuple(fds.values()),
                                start_new_session=True, env={}, cwd="/", **user)
    except BaseException:
        if cgroup:
            cgroup.remove()
        raise
    finally:
        for fd in (*fds.values(), stdin_fd):
            os.close(fd)
    try:
        timed_out = not _exited_within(proc, wall_s)
    finally:
        # bwrap leads its own process group; its sandboxed child dies with it (--die-with-parent), and with
        # that child, as PID 1 of the sandbox's namespace, every process the program left behind.
        try:
            os.killpg(proc.pid, 9)
        except (ProcessLookupError, PermissionError):
            pass
        proc.wait()
        if cgroup:
            cgroup.remove()
    code = proc.returncode
    if not timed_out and code is not None and 128 < code <= 128 + 64:
        code = -(code - 128)  # bwrap reports a child killed by signal N as 128 + N
    return Raw(out_fd, err_fd, None if timed_out else code, timed_out, time.monotonic() - start)


PROBE = """
import ctypes, os
libc = ctypes.CDLL(None)
proc = os.path.exists('/proc/self/status')
status = dict(line.split(':', 1) for line in open('/proc/self/status')) if proc else {}
nics = len(open('/proc/net/dev').read().splitlines()) - 2 if proc else 1
seccomp = libc.prctl(21, 0, 0, 0, 0)  # PR_GET_SECCOMP: 2 under a filter (read without /proc too)
nested_userns = libc.unshare(0x10000000) == 0  # CLONE_NEWUSER: must be refused
print(os.getuid(), os.getgid(), status.get('CapEff', '0').strip(), seccomp, nics, int(nested_userns))
"""

# How bwrap 0.8 says that the host refused one of its steps, and the layout that does without that step.
PROC_REFUSED = "Can't mount proc"  # the runtime masks parts of /proc (a container): no fresh one can be mounted
SYSCTL_REFUSED = "max_user_namespaces"  # /proc/sys is read-only (a container): --disable-userns cannot set it

HOW_TO_ALLOW = (
    "It needs unprivileged user namespaces (sysctl user.max_user_namespaces > 0 on the host or node; on Ubuntu >= "
    "23.10 also kernel.apparmor_restrict_unprivileged_userns=0) and a container profile that lets the worker call "
    "unshare/clone/mount/pivot_root. Docker: `docker run --security-opt seccomp=unconfined --security-opt "
    "apparmor=unconfined` (compose: `security_opt: [seccomp=unconfined, apparmor=unconfined]`). Podman: `podman "
    "run --security-opt seccomp=unconfined --security-opt apparmor=unconfined` (the same compose keys). "
    "Kubernetes: the container's securityContext `seccompProfile: {type: Unconfined}` and `appArmorProfile: "
    "{type: Unconfined}` (infra/k8s/base/env-worker.yaml), on nodes with that sysctl. None of them needs "
    "privileged mode, capabilities or a writable /proc/sys. Or choose another mode (SANDBOX_MODES=container). "
    "See docs/security.md")


@functools.cache
def layout() -> Layout:
    """Checked once per process: a real sandbox runs and reports what it should, else SandboxUnavailable with
    the reason (never a silent fall back to a weaker guard)."""
    lay = _layout()
    try:
        bpf_program()
    except (ImportError, OSError, RuntimeError) as e:
        raise SandboxUnavailable("sandbox mode 'namespaces' needs libseccomp (apt-get install libseccomp2) and PyPI "
                                 f"pyseccomp (in the core dependencies) for its seccomp filter: {e}") from None
    err = _probe(lay)
    while err:
        if PROC_REFUSED in err and lay.proc:
            lay = replace(lay, proc=False)  # the sandbox then has no /proc at all: a smaller view, not a weaker one
        elif SYSCTL_REFUSED in err and lay.userns_sysctl:
            # Not weaker either: the seccomp filter refuses every way into a new user namespace (unshare, setns,
            # clone with CLONE_NEWUSER, clone3), and the probe checks that one is refused.
            lay = replace(lay, userns_sysctl=False)
        else:
            raise SandboxUnavailable(f"sandbox mode 'namespaces' does not work on this host: {err}. {HOW_TO_ALLOW}")
        err = _probe(lay)
    return lay


def _probe(lay: Layout) -> str | None:
    cfg = {"cpu_s": 5, "memory_bytes": 1 << 30, "file_bytes": 1 << 20, "max_procs": 16}
    raw = run(lay, {"main.py": PROBE}, "", cfg, 30, 1 << 20)
    try:
        out, err = _read(raw.stdout_fd), _read(raw.stderr_fd)
    finally:
        os.close(raw.stdout_fd)
        os.close(raw.stderr_fd)
    if raw.exit_code != 0:
        return f"bwrap exited with {raw.exit_code}: {(err or out).strip()[-500:]}"
    uid, gid, caps, seccomp, nics, nested_userns = out.split()
    if (int(uid), int(gid)) != (SANDBOX_UID, SANDBOX_UID) or int(caps, 16) != 0 or seccomp != "2":
        return f"the sandbox came up wrong (uid {uid}, gid {gid}, CapEff {caps}, Seccomp {seccomp})"
    if int(nics) > 1:
        return f"the sandbox sees {nics} network interfaces (only loopback expected)"
    if nested_userns != "0":
        return "a program in the sandbox could create a user namespace (the seccomp filter must refuse it)"
    return None


def _read(fd: int, cap: int = 1 << 16) -> str:
    os.lseek(fd, 0, os.SEEK_SET)
    return os.read(fd, cap).decode(errors="replace")
