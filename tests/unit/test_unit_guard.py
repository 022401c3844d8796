"""The unit tier's guard (tests/unit/conftest.py) refuses processes and sockets, and the tier marker comes from
the folder (tests/conftest.py)."""

from __future__ import annotations

import asyncio
import socket
import subprocess
import sys

import pytest


def test_unit_tests_carry_the_unit_marker(request) -> None:
    assert request.node.get_closest_marker("unit") is not None


def test_a_subprocess_is_refused() -> None:
    with pytest.raises(RuntimeError, match="may not start a subprocess"):
        subprocess.run([sys.executable, "-c", "pass"])


def test_an_asyncio_subprocess_is_refused() -> None:
    async def spawn() -> None:
        await asyncio.create_subprocess_exec(sys.executable, "-c", "pass")

    with pytest.raises(RuntimeError, match="may not start a subprocess"):
        asyncio.run(spawn())


def test_a_socket_connection_is_refused() -> None:
    with socket.socket() as s, pytest.raises(RuntimeError, match="may not connect a socket"):
        s.connect(("127.0.0.1", 6379))
    with pytest.raises(RuntimeError, match="may not connect a socket"):
        socket.create_connection(("127.0.0.1", 5432), timeout=1)
