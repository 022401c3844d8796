"""The unit tier stays pure: a unit test that starts a process or connects a socket (Redis, Postgres, a server,
DNS over TCP) fails here, naming what it did; such a test belongs in tests/component or beyond."""

from __future__ import annotations

import socket
import subprocess

import pytest


def _refuse(what: str):
    def refuse(*args, **kwargs):
        raise RuntimeError(f"a unit test may not {what} (tests/unit is pure: move the test to tests/component)")
    return refuse


@pytest.fixture(autouse=True)
def _pure(monkeypatch) -> None:
    # _execute_child is where every Popen (subprocess.run, asyncio's subprocesses) forks: patching it catches
    # callers that imported Popen by name too.
    monkeypatch.setattr(subprocess.Popen, "_execute_child", _refuse("start a subprocess"))
    monkeypatch.setattr(socket.socket, "connect", _refuse("connect a socket"))
    monkeypatch.setattr(socket.socket, "connect_ex", _refuse("connect a socket"))
