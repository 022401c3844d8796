"""What the local stack started dies with it, however the stack dies (a SIGKILL runs no handler of its own):

    python -m infra.local.watchdog    # started by LocalStack in a session of its own; reads commands on stdin

The stack holds the write end of this process's stdin; the kernel closes it when the stack exits for any
reason, and the watchdog reads end-of-file. Lines before that: `+PID` (a process group the stack started),
`-PID` (stopped by the stack: forget it), `pg PGDATA` / `-pg PGDATA` (an embedded PostgreSQL, which pg_ctl
daemonized: no parent-death signal reaches it). At end-of-file it sends SIGTERM to every group still listed and
a fast shutdown to each PostgreSQL, then SIGKILL / an immediate shutdown to what is left after GRACE_S.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

GRACE_S = float(os.environ.get("STACK_WATCHDOG_GRACE_S", "10"))


def postmaster(pgdata: str) -> int | None:
    """The PostgreSQL serving `pgdata`, if one runs (its postmaster.pid, checked against a reused pid)."""
    import psutil

    try:
        pid = int((Path(pgdata) / "postmaster.pid").read_text().split()[0])
        return pid if "postgres" in psutil.Process(pid).name() else None
    except (OSError, ValueError, IndexError, psutil.Error):
        return None


def alive(group: int) -> bool:
    try:
        os.killpg(group, 0)
        return True
    except (ProcessLookupError, PermissionError):
        return False


def signal_all(groups: set[int], pgdatas: set[str], group_sig: int, pg_sig: int) -> None:
    for group in groups:
        try:
            os.killpg(group, group_sig)
        except (ProcessLookupError, PermissionError):
            pass
    for pgdata in pgdatas:
        if (pid := postmaster(pgdata)) is not None:
            os.kill(pid, pg_sig)


def main() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C is the stack's to handle, in order
    groups: set[int] = set()
    pgdatas: set[str] = set()
    for line in sys.stdin:
        cmd, _, arg = line.strip().partition(" ")
        if cmd.startswith("+"):
            groups.add(int(cmd[1:]))
        elif cmd.startswith("-") and cmd != "-pg":
            groups.discard(int(cmd[1:]))
        elif cmd == "pg":
            pgdatas.add(arg)
        elif cmd == "-pg":
            pgdatas.discard(arg)
    if not groups and not pgdatas:
        return  # the stack stopped everything itself
    print(f"the stack is gone; stopping what it left: process groups {sorted(groups)}, PostgreSQL {sorted(pgdatas)}",
          file=sys.stderr, flush=True)
    signal_all(groups, pgdatas, signal.SIGTERM, signal.SIGINT)  # SIGINT: PostgreSQL's fast shutdown
    deadline = time.monotonic() + GRACE_S
    while time.monotonic() < deadline and (any(map(alive, groups)) or any(map(postmaster, pgdatas))):
        time.sleep(0.1)
    signal_all(groups, pgdatas, signal.SIGKILL, signal.SIGQUIT)  # SIGQUIT: PostgreSQL's immediate shutdown


if __name__ == "__main__":
    main()
