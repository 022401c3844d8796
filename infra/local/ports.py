"""Loopback ports: a free one to listen on, and waiting until something listens."""

from __future__ import annotations

import fcntl
import os
import socket
import subprocess
import tempfile
import time
from pathlib import Path

POOL = 16_000  # ports handed out, just below the kernel's ephemeral range
_COUNTER = Path(tempfile.gettempdir()) / f"flywheel-free-port-{os.getuid()}"


def free_port() -> int:
    """A TCP port on 127.0.0.1 nothing is bound to now, for a process started next to listen on.

    Taken below the kernel's ephemeral range, in turn from a counter every process on this host shares: an
    ephemeral port can become the local end of any outgoing connection (a Redis or Postgres client) between
    this pick and the server's bind, and two pickers in turn do not pick the same port."""
    first_ephemeral = _first_ephemeral_port()
    base = max(1024, first_ephemeral - POOL)
    with open(_COUNTER, "a+") as f:  # noqa: PTH123
        fcntl.flock(f, fcntl.LOCK_EX)
        f.seek(0)
        turn = int(f.read() or os.getpid())
        for step in range(1, first_ephemeral - base + 1):
            port = base + (turn + step) % (first_ephemeral - base)
            if _bindable(port):
                f.seek(0)
                f.truncate()
                f.write(str(turn + step))
                return port
    raise OSError(f"no free port in {base}-{first_ephemeral - 1} on 127.0.0.1")


def _first_ephemeral_port() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def port_open(port: int, timeout_s: float = 0.5) -> bool:
    """True when something accepts connections on 127.0.0.1:port."""
    with socket.socket() as s:
        s.settimeout(timeout_s)
        return s.connect_ex(("127.0.0.1", port)) == 0


def wait_port(port: int, proc: subprocess.Popen | None = None, timeout_s: float = 30) -> None:
    """Return once 127.0.0.1:port accepts connections; raise if `proc` exits first or the time runs out."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"process for port {port} exited with {proc.returncode}")
        if port_open(port):
            return
        time.sleep(0.1)
    raise TimeoutError(f"nothing listens on port {port} after {timeout_s:.0f}s")
