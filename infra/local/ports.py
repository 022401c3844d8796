"""Loopback ports: a free one to listen on, and waiting until something listens."""

from __future__ import annotations

import socket
import subprocess
import time


def free_port() -> int:
    """A TCP port on 127.0.0.1 nothing listens on now (the OS picks it; a race with other binders is possible)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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
