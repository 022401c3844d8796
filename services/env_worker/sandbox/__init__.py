"""Run model-written Python (tool calls, generated code, unit tests) behind a boundary, with limits.

    result = run_python("print(1 + 1)", limits=SandboxLimits(wall_s=5), mode="namespaces")
    result.ok, result.stdout, result.timed_out, result.error

Modes (`MODES`): `namespaces` (the default, bubblewrap: ns.py), `container` (container.py) and `none` (NO
kernel boundary: only for trusted code, and only when asked for by name). A mode that cannot run on this host
raises SandboxUnavailable with the reason; nothing falls back to a weaker mode (`check_mode` checks up front).

More: docs/security.md#inside-the-sandboxes
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from services.env_worker.sandbox import ns as sandbox_ns
from services.env_worker.sandbox.ns import SandboxUnavailable
from shared.contracts.run_config import DEFAULT_SANDBOX_MODE, SANDBOX_MODES

BOOT = Path(__file__).with_name("boot.py")
MODES, DEFAULT_MODE = SANDBOX_MODES, DEFAULT_SANDBOX_MODE  # named in the run config (a contract)
TRUNCATED = "\n[output truncated]"  # appended to an output cut at `output_bytes`
EXCEPTION_LINE = re.compile(r"^[A-Za-z_][\w.]*(Error|Exception|Exit|Interrupt)\b")
__all__ = ["MODES", "DEFAULT_MODE", "SandboxLimits", "SandboxResult", "SandboxUnavailable", "check_mode",
           "run_python", "sandbox_mode"]


@dataclass(frozen=True)
class SandboxLimits:
    wall_s: float = 10.0  # wall clock, seconds; the process group is killed after it
    cpu_s: int = 10  # CPU seconds (RLIMIT_CPU)
    memory_bytes: int = 1 << 30  # address space (RLIMIT_AS); Python alone maps ~40 MB
    file_bytes: int = 8 << 20  # largest file the program may write, incl. its stdout/stderr (RLIMIT_FSIZE)
    output_bytes: int = 16 << 10  # stdout / stderr returned to the caller, each, bytes
    max_procs: int = 32  # RLIMIT_NPROC: processes+threads (namespaces: per sandbox; none: non-root workers only)
    disk_bytes: int = 64 << 20  # namespaces: size of the work dir and of /tmp (tmpfs, each), bytes


@dataclass
class SandboxResult:
    stdout: str
    stderr: str
    exit_code: int | None
    timed_out: bool
    truncated: bool
    duration_s: float
    mode: str = DEFAULT_MODE

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
        tail = self.stderr.rstrip().splitlines()
        # The last line is the reason unless it was cut off (the output cap) or is a traceback's frame line (the
        # streams of processes killed mid-write interleave): then the last exception line kept is.
        if tail and (tail[-1] == TRUNCATED.strip() or tail[-1][:1].isspace()):
            tail = [line for line in tail if EXCEPTION_LINE.match(line)] or tail
        return tail[-1].strip() if tail else f"exit code {self.exit_code}"


def sandbox_mode(mode: object) -> str:
    """An env's `sandbox` arg, validated: one of MODES (None: the default)."""
    if mode is None:
        return DEFAULT_MODE
    if mode not in MODES:
        raise ValueError(f"unknown sandbox mode {mode!r}; choose one of {', '.join(MODES)} (env arg `sandbox`)")
    return str(mode)


def check_mode(mode: str) -> None:
    """Raise SandboxUnavailable (or ValueError for an unknown mode) unless `mode` can run here."""
    if sandbox_mode(mode) == "namespaces":
        sandbox_ns.layout()
    elif mode == "container":
        from services.env_worker.sandbox import container as sandbox_container
        sandbox_container.client()


def run_python(code: str, *, stdin: str = "", files: dict[str, str] | None = None,
               limits: SandboxLimits = SandboxLimits(), mode: str = DEFAULT_MODE,
               image: str | None = None) -> SandboxResult:
    """Execute `code` as `main.py` in a fresh work dir (plus `files`), return its captured output. Mode
    `container` runs it in a fresh container of `image` (from the warm pool), removed afterwards."""
    if mode == "container":
        session = container_session(image, limits)
        try:
            return session.run_python(code, stdin=stdin, files=files, limits=limits)
        finally:
            session.close()
    check_mode(mode)
    if mode == "namespaces":
        return _run_namespaced(code, stdin, files or {}, limits)
    workdir = Path(tempfile.mkdtemp(prefix="fw-sandbox-"))
    try:
        (workdir / "main.py").write_text(code)
        for name, text in (files or {}).items():
            (workdir / Path(name).name).write_text(text)
        return _run(workdir, stdin, limits)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def container_session(image: str | None, limits: SandboxLimits):
    """A container of `image` for one env session (mode `container`), its limits from `limits`."""
    from services.env_worker.sandbox import container as sandbox_container
    if not image:
        raise ValueError("sandbox mode 'container' needs the env arg `image` (e.g. localhost/flywheel-sandbox-python:local)")
    spec = sandbox_container.ContainerSpec(image, memory_bytes=limits.memory_bytes, max_procs=max(16, limits.max_procs),
                                           disk_bytes=limits.disk_bytes)
    return sandbox_container.pool_for(spec).acquire()


def _limits_cfg(limits: SandboxLimits) -> dict:
    return {"cpu_s": limits.cpu_s, "memory_bytes": limits.memory_bytes, "file_bytes": limits.file_bytes,
            "max_procs": limits.max_procs}


def _run_namespaced(code: str, stdin: str, files: dict[str, str], limits: SandboxLimits) -> SandboxResult:
    named = {Path(name).name: text for name, text in files.items() if Path(name).name not in ("", "main.py")}
    raw = sandbox_ns.run(sandbox_ns.layout(), {"main.py": code, **named}, stdin, _limits_cfg(limits),
                         limits.wall_s, limits.disk_bytes)
    try:
        stdout, t1 = _read_fd_capped(raw.stdout_fd, limits.output_bytes)
        stderr, t2 = _read_fd_capped(raw.stderr_fd, limits.output_bytes)
    finally:
        os.close(raw.stdout_fd)
        os.close(raw.stderr_fd)
    return SandboxResult(stdout, stderr, raw.exit_code, raw.timed_out, t1 or t2, raw.duration_s, "namespaces")


def _read_fd_capped(fd: int, cap: int) -> tuple[str, bool]:
    os.lseek(fd, 0, os.SEEK_SET)
    with os.fdopen(os.dup(fd), "rb") as f:
        return _capped(f.read(cap + 1), cap)


def _capped(data: bytes, cap: int) -> tuple[str, bool]:
    truncated = len(data) > cap
    return data[:cap].decode(errors="replace") + (TRUNCATED if truncated else ""), truncated


def _run(workdir: Path, stdin: str, limits: SandboxLimits) -> SandboxResult:
    cfg = json.dumps({**_limits_cfg(limits), "guard": "hook"})
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
                         time.monotonic() - start, "none")


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
        return _capped(f.read(cap + 1), cap)
