"""Run untrusted Python (tool calls, generated code, unit tests) in a separate, limited process.

    result = run_python("print(1 + 1)", limits=SandboxLimits(wall_s=5))
    result.ok, result.stdout, result.timed_out, result.error

What it protects against (each covered by tests/unit/builtin/test_builtin_sandbox.py):
- runaway CPU: RLIMIT_CPU, and a wall-clock limit after which the whole process group is SIGKILLed;
- memory bombs: RLIMIT_AS (allocation fails with MemoryError inside the child);
- fork bombs: process creation (fork, exec, subprocess, posix_spawn, os.system) is refused by an audit hook;
  RLIMIT_NPROC backs this up when the worker does not run as root (the kernel does not apply it to root);
- network: the child enters a fresh network namespace when the kernel allows it (root or unprivileged user
  namespaces; loopback only, down), and an audit hook refuses socket creation in any case;
- writes outside its own temp dir (the child's cwd, deleted afterwards): refused by the audit hook on `open`
  and file-system calls; file size capped by RLIMIT_FSIZE;
- reads and directory listings outside its temp dir and the Python installation (stdlib, site-packages):
  refused by the same hook, so the worker's files, the repo and /etc stay unreadable;
- huge output: stdout/stderr go to files capped by RLIMIT_FSIZE and are read back truncated to `output_bytes`;
- killing or signalling other processes (os.kill is refused).

What it does NOT protect against: the audit hook is a Python-level guard, not a security boundary. Code that
reaches native code (a C extension with its own syscalls, an interpreter bug, gc/introspection tricks)
can bypass it; ctypes/cffi imports are refused to close the obvious hole. There is no seccomp, no mount namespace, no separate user. For
hostile code at scale, run env workers in a container/gVisor/Firecracker sandbox; this module keeps a buggy or
mildly adversarial program from killing or hanging the worker.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

BOOT = Path(__file__).with_name("sandbox_boot.py")


@dataclass(frozen=True)
class SandboxLimits:
    wall_s: float = 10.0  # wall clock, seconds; the process group is killed after it
    cpu_s: int = 10  # CPU seconds (RLIMIT_CPU)
    memory_bytes: int = 1 << 30  # address space (RLIMIT_AS); Python alone maps ~40 MB
    file_bytes: int = 8 << 20  # largest file the program may write, incl. its stdout/stderr (RLIMIT_FSIZE)
    output_bytes: int = 16 << 10  # stdout / stderr returned to the caller, each, bytes
    max_procs: int = 64  # RLIMIT_NPROC (effective for non-root workers only)


@dataclass
class SandboxResult:
    stdout: str
    stderr: str
    exit_code: int | None
    timed_out: bool
    truncated: bool
    duration_s: float

    @property
    def ok(self) -> bool:
        return self.exit_code == 0 and not self.timed_out

    @property
    def error(self) -> str | None:
        """A one-line reason when not ok, suitable as a tool observation."""
        if self.timed_out:
            return "timed out (wall-clock limit)"
        if self.exit_code == 0:
            return None
        if self.exit_code is not None and self.exit_code < 0:
            return f"killed by signal {signal.Signals(-self.exit_code).name}"
        tail = self.stderr.strip().splitlines()
        return tail[-1] if tail else f"exit code {self.exit_code}"


def run_python(code: str, *, stdin: str = "", files: dict[str, str] | None = None,
               limits: SandboxLimits = SandboxLimits()) -> SandboxResult:
    """Execute `code` as `main.py` in a fresh temp dir (plus `files`), return its captured output."""
    workdir = Path(tempfile.mkdtemp(prefix="fw-sandbox-"))
    try:
        (workdir / "main.py").write_text(code)
        for name, text in (files or {}).items():
            (workdir / Path(name).name).write_text(text)
        return _run(workdir, stdin, limits)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def _run(workdir: Path, stdin: str, limits: SandboxLimits) -> SandboxResult:
    cfg = json.dumps({"cpu_s": limits.cpu_s, "memory_bytes": limits.memory_bytes,
                      "file_bytes": limits.file_bytes, "max_procs": limits.max_procs})
    out_path, err_path = workdir / ".stdout", workdir / ".stderr"
    start = time.monotonic()
    with open(out_path, "wb") as out, open(err_path, "wb") as err:
        proc = subprocess.Popen(
            [sys.executable, "-I", str(BOOT), cfg], cwd=workdir, stdin=subprocess.PIPE, stdout=out, stderr=err,
            start_new_session=True, env={"PATH": "/usr/bin:/bin", "PYTHONHASHSEED": "0", "HOME": str(workdir)},
        )
        timed_out = _wait(proc, stdin, limits.wall_s)
    stdout, t1 = _read_capped(out_path, limits.output_bytes)
    stderr, t2 = _read_capped(err_path, limits.output_bytes)
    return SandboxResult(stdout, stderr, None if timed_out else proc.returncode, timed_out, t1 or t2,
                         time.monotonic() - start)


def _wait(proc: subprocess.Popen, stdin: str, wall_s: float) -> bool:
    try:
        proc.communicate(stdin.encode(), timeout=wall_s)
        return False
    except subprocess.TimeoutExpired:
        return True
    finally:
        _kill_group(proc)


def _kill_group(proc: subprocess.Popen) -> None:
    # The child leads its own session: SIGKILL the group so nothing it started outlives it.
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    proc.wait()


def _read_capped(path: Path, cap: int) -> tuple[str, bool]:
    with open(path, "rb") as f:
        data = f.read(cap + 1)
    truncated = len(data) > cap
    return data[:cap].decode(errors="replace") + ("\n[output truncated]" if truncated else ""), truncated
