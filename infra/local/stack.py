"""Every flywheel service as local processes, no docker: `make up`, or

    flywheel-stack [--services api,controller,...] [--rollout-workers 2] [--env-workers 2]

With REDIS_URL / DATABASE_URL unset it starts embedded real servers under DATA_DIR; migrations run first. The
console entry supervises: a service (or embedded server) that exits is restarted after a backoff. Any signal
stops everything, and no signal, however many arrive, leaves a process behind; a SIGKILL neither
(infra/local/watchdog.py). `LocalStack` is the same for tests, with supervision opt-in.

More: docs/deploy.md#the-local-stack-from-python
"""

from __future__ import annotations

import logging
import math
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import IO

import httpx

from infra.local.ports import free_port
from infra.local.servers import PostgresServer, RedisServer
from shared.platform.logs import get_logger

log = get_logger(__name__)
REPO = Path(__file__).resolve().parents[2]


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


@dataclass(frozen=True)
class Placement:
    """Where one instance runs, when not as a plain child process on this host: a command prefix (e.g.
    `ip netns exec NS`: another network namespace), the address its port is reached at, extra environment."""

    prefix: tuple[str, ...] = ()
    host: str = "127.0.0.1"
    env: dict[str, str] = field(default_factory=dict)


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
    watch: Watch | None = None  # restart bookkeeping, once the stack supervises
    placement: Placement = field(default_factory=Placement)

    @property
    def label(self) -> str:
        return f"{self.name}-{self.index}"

    @property
    def url(self) -> str:
        return f"http://{self.placement.host}:{self.port}"

    @property
    def health_url(self) -> str:
        return f"{self.url}/healthz"

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def log_tail(self) -> str:
        return "".join(self.tail) or "(no output)"

    def exit_detail(self) -> str:
        code = self.proc.returncode if self.proc is not None else None
        last = [line.rstrip() for line in list(self.tail)[-3:]]
        return f"exited with code {code}; see {self.log_path}" + ("; last output:\n  " + "\n  ".join(last) if last else "")


@dataclass
class Backoff:
    """Restart delays for one supervised process: base, 2x base, 4x base, ... up to cap; back to base once the
    process has stayed up reset_after_s (a crash an hour later is not part of the same crash loop)."""

    base_s: float = 1.0
    cap_s: float = 30.0
    reset_after_s: float = 60.0
    failures: int = 0

    def next_delay(self, uptime_s: float) -> float:
        if uptime_s >= self.reset_after_s:
            self.failures = 0
        delay = min(self.cap_s, self.base_s * 2 ** self.failures)
        self.failures += 1
        return delay


@dataclass
class Watch:
    """What the supervisor knows of one process: since when it runs, when it is due to restart, how often it
    has been restarted, and the last delay it waited."""

    label: str
    backoff: Backoff
    started_at: float = field(default_factory=time.monotonic)
    restart_at: float | None = None
    restarts: int = 0
    last_delay_s: float = 0.0


class LocalStack:
    """Starts, watches and stops the services (and embedded Redis/Postgres when no URLs are given).

    `env` overrides the inherited environment for every service (REDIS_URL, DATABASE_URL, API_PORT, ...);
    `echo` mirrors service output to this process's stdout with a name prefix (logs are always written): every
    line (True or "all"), or only what a user acts on ("important": see `ConsoleFilter`);
    `backoff` shapes the restart delays once `supervise()` was called; `placement(name, index)` says where an
    instance runs (tests/support/netns.py's namespaces: the weight-sync bench), default here.
    """

    def __init__(
        self,
        data_dir: str | Path | None = None,
        env: dict[str, str] | None = None,
        *,
        specs: dict[str, ServiceSpec] | None = None,
        echo: bool | str = False,
        stop_timeout_s: float = 25.0,
        backoff: Backoff | None = None,
        placement: Callable[[str, int], Placement] | None = None,
    ):
        self.placement = placement
        self.env = dict(env or {})
        self.data_dir = Path(data_dir or self.env.get("DATA_DIR") or os.environ.get("DATA_DIR") or ".data").resolve()
        self.specs = dict(specs or SERVICES)
        self.echo = echo
        self.stop_timeout_s = stop_timeout_s
        self.backoff = backoff or Backoff()
        self.instances: list[Instance] = []
        self.redis: RedisServer | None = None
        self.postgres: PostgresServer | None = None
        self.redis_url = ""
        self.database_url = ""
        self._console_lock = threading.Lock()
        self._lock = threading.RLock()  # one of: the supervisor's restart pass, restart(), start(), stop()
        self._stopped = True
        self._hurry = threading.Event()  # set: stop() kills at once instead of waiting for graceful exits
        self._supervisor: threading.Thread | None = None
        self._supervisor_stop = threading.Event()
        self._server_watches: dict[str, Watch] = {}
        self._watchdog: subprocess.Popen | None = None

    # ---- lifecycle

    def start(self, services: list[str] | None = None, counts: dict[str, int] | None = None) -> LocalStack:
        """Start backing servers, migrate, then launch `counts[name]` (default 1) processes per service.
        Called again on a running stack, it adds processes (e.g. a third rollout worker) after the existing."""
        names = list(self.specs) if services is None else services
        unknown = [n for n in names if n not in self.specs]
        if unknown:
            raise ValueError(f"unknown service(s) {unknown}; choose from {', '.join(self.specs)}")
        with self._lock:
            if self._stopped:
                self._stopped = False
                self._hurry.clear()
                self.instances = []
                (self.data_dir / "logs").mkdir(parents=True, exist_ok=True)
                self._start_watchdog()
                self._start_backing_servers()
                self._migrate()
            for name in sorted(names, key=list(self.specs).index):  # weight-server first: others get its URL
                first = sum(1 for i in self.instances if i.name == name)
                for index in range(first, first + (counts or {}).get(name, 1)):
                    inst = self._new_instance(name, index)
                    self._spawn(inst)
                    if self._supervisor is not None:
                        inst.watch = Watch(inst.label, replace(self.backoff, failures=0))
            self._write_env_file()
        return self

    @property
    def env_file(self) -> Path:
        return self.data_dir / "stack.env"

    def _write_env_file(self) -> None:
        """$DATA_DIR/stack.env: the addresses a process started by hand needs to join this stack (an extra
        worker in another terminal: `set -a; . .data/stack.env; set +a`). Owner-only: URLs may hold passwords."""
        env = self._base_env()
        keys = ("REDIS_URL", "DATABASE_URL", "CELERY_BROKER_URL", "DATA_DIR", "WEIGHTS_DIR", "WEIGHT_SERVER_URL")
        if any(i.name == "api" for i in self.instances):
            env["FLYWHEEL_API_URL"] = self.api_url  # the CLI, sourced in another terminal
            keys += ("FLYWHEEL_API_URL",)
        text = "".join(f"{k}='{env[k]}'\n" for k in keys if k in env)
        self.env_file.touch(mode=0o600)
        self.env_file.write_text(text)

    def _start_backing_servers(self) -> None:
        self.redis_url = self.env.get("REDIS_URL") or os.environ.get("REDIS_URL", "")
        self.database_url = self.env.get("DATABASE_URL") or os.environ.get("DATABASE_URL", "")
        if not self.redis_url:
            self.redis = RedisServer(self.data_dir / "redis", unix_socket=True)
            self._start_server(self.redis)
            self.redis_url = self.redis.url
            log.info("embedded Redis at %s (data in %s)", self.redis_url, self.data_dir / "redis")
        if not self.database_url:
            self.postgres = PostgresServer(self.data_dir / "postgres")
            self._start_server(self.postgres)
            self.database_url = self.postgres.url
            log.info("embedded PostgreSQL at %s", self.database_url)

    def _start_server(self, server: RedisServer | PostgresServer) -> None:
        if isinstance(server, PostgresServer):
            self._tell(f"pg {server.folder.resolve()}")  # before: a stack killed while it starts leaves none
            server.start()
            return
        if server.pid is not None:
            self._tell(f"-{server.pid}")  # the one that died
        server.start()
        self._tell(f"+{server.pid}")  # its own session: the group is its pid

    # ---- the watchdog: whatever was started dies with this process (infra/local/watchdog.py)

    def _start_watchdog(self) -> None:
        # Its own session, so a signal to our process group (Ctrl-C, a supervisor's SIGKILL) leaves it to act.
        with open(self.data_dir / "logs" / "stack.log", "ab") as out:
            self._watchdog = subprocess.Popen([sys.executable, "-m", "infra.local.watchdog"], cwd=REPO,
                                              stdin=subprocess.PIPE, stdout=out, stderr=out, start_new_session=True)

    def _tell(self, line: str) -> None:
        try:
            self._watchdog.stdin.write(f"{line}\n".encode())
            self._watchdog.stdin.flush()
        except (AttributeError, BrokenPipeError, ValueError):  # none (a stack used without start()) or gone
            pass

    def _stop_watchdog(self) -> None:
        watchdog, self._watchdog = self._watchdog, None
        if watchdog is not None:
            watchdog.stdin.close()  # end-of-file with nothing listed: it exits at once
            try:
                watchdog.wait(5)
            except subprocess.TimeoutExpired:
                watchdog.kill()
                watchdog.wait()

    def _migrate(self) -> None:
        from shared.platform.db.migrate import upgrade
        from shared.platform.settings import ServiceSettings

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
        }
        if weight_server is not None:
            env["WEIGHT_SERVER_URL"] = f"http://127.0.0.1:{weight_server.port}"
        return env

    def _new_instance(self, name: str, index: int) -> Instance:
        spec = self.specs[name]
        fixed = self.env.get(spec.port_env) if spec.port_env != "HEALTH_PORT" and index == 0 else None
        port = int(fixed) if fixed else free_port()
        where = self.placement(name, index) if self.placement else Placement()
        env = {**self._base_env(), "HEALTH_PORT": "0", spec.port_env: str(port), "WORKER_ID": f"{name}-{index}",
               **where.env}
        inst = Instance(name, index, spec, env, port, self.data_dir / "logs" / f"{name}-{index}.log",
                        placement=where)
        self.instances.append(inst)
        return inst

    def _spawn(self, inst: Instance) -> None:
        # Own session = own process group: Ctrl-C reaches only the stack, which then stops each group whole
        # (a service's children, e.g. Celery's pool, die with it).
        inst.proc = subprocess.Popen(
            [*inst.placement.prefix, sys.executable, *inst.spec.args], cwd=REPO, env=inst.env, stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True,
        )
        self._tell(f"+{inst.proc.pid}")
        inst.reader = threading.Thread(target=self._pump, args=(inst, inst.proc.stdout), daemon=True)
        inst.reader.start()
        log.info("started %s (pid %d, port %d)", inst.label, inst.proc.pid, inst.port)

    def _pump(self, inst: Instance, stream: IO[bytes]) -> None:
        width = max(len(n) for n in self.specs) + 3
        shown = ConsoleFilter() if self.echo == "important" else (lambda line: bool(self.echo))
        with open(inst.log_path, "ab") as out:
            for raw in iter(stream.readline, b""):
                out.write(raw)
                out.flush()
                line = raw.decode(errors="replace")
                inst.tail.append(line)
                if shown(line):
                    with self._console_lock:
                        sys.stdout.write(f"{inst.label:<{width}}| {line}")
                        sys.stdout.flush()
        stream.close()

    def wait_healthy(self, timeout_s: float = 60.0, interrupted: threading.Event | None = None) -> None:
        """Poll every instance's /healthz until all answer 200; raise with the log tail of the ones that died
        or did not become healthy in time. Returns early once `interrupted` is set."""
        pending = [i for i in self.instances if i.proc is not None]
        deadline = time.monotonic() + timeout_s
        with httpx.Client(timeout=1.0) as http:
            while pending and not (interrupted is not None and interrupted.is_set()):
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
        """Signal one service's whole process group (chaos: SIGKILL is a crash, SIGTERM a graceful stop). A
        supervised stack restarts what exits."""
        _signal_group(self.instance(name, index), sig)

    def restart(self, name: str, index: int = 0) -> None:
        """Stop one instance (if still running) and start it again on the same port and worker id."""
        with self._lock:
            inst = self.instance(name, index)
            self._terminate([inst])
            self._spawn(inst)
            if inst.watch is not None:
                inst.watch.started_at, inst.watch.restart_at = time.monotonic(), None

    # ---- supervision

    def supervise(self, interval_s: float = 0.5) -> None:
        """From now on, restart whatever exits or dies: service processes, and the embedded Redis/Postgres
        (at the same address), each after its own backoff, each restart logged with the exit code."""
        with self._lock:
            if self._supervisor is not None:
                return
            for inst in self.instances:
                inst.watch = Watch(inst.label, replace(self.backoff, failures=0))
            for key, label in (("redis", "embedded Redis"), ("postgres", "embedded PostgreSQL")):
                if getattr(self, key) is not None:
                    self._server_watches[key] = Watch(label, replace(self.backoff, failures=0))
            self._supervisor_stop.clear()
            self._supervisor = threading.Thread(target=self._supervise, args=(interval_s,), daemon=True,
                                                name="supervisor")
            self._supervisor.start()

    def _supervise(self, interval_s: float) -> None:
        while not self._supervisor_stop.wait(interval_s):
            with self._lock:
                if self._stopped:
                    return
                # Servers first: a service restarted before its Redis is back would only crash again.
                for key, watch in self._server_watches.items():
                    server = getattr(self, key)
                    self._check(watch, server.alive, server.exit_detail, lambda s=server: self._start_server(s))
                for inst in self.instances:
                    if inst.watch is not None and inst.proc is not None:
                        self._check(inst.watch, inst.alive, inst.exit_detail, lambda i=inst: self._respawn(i))

    def _check(self, watch: Watch, alive: bool, exit_detail: Callable[[], str], start: Callable[[], None]) -> None:
        now = time.monotonic()
        if alive:
            return
        if watch.restart_at is None:  # just found dead
            watch.last_delay_s = watch.backoff.next_delay(now - watch.started_at)
            watch.restart_at = now + watch.last_delay_s
            log.error("%s %s (up %.0fs); restarting it in %.1fs (restart %d)", watch.label, exit_detail(),
                      now - watch.started_at, watch.last_delay_s, watch.restarts + 1)
            return
        if now < watch.restart_at:
            return
        try:
            start()
        except Exception as e:  # e.g. Postgres's shared memory still held by its dying backends: retry later
            watch.last_delay_s = watch.backoff.next_delay(0.0)
            watch.restart_at = time.monotonic() + watch.last_delay_s
            log.error("%s could not be restarted (%s); next try in %.1fs", watch.label, e, watch.last_delay_s)
            return
        watch.restarts += 1
        watch.started_at, watch.restart_at = time.monotonic(), None
        log.warning("%s restarted (restart %d)", watch.label, watch.restarts)

    def _respawn(self, inst: Instance) -> None:
        _signal_group(inst, signal.SIGKILL)  # what its dead leader left behind (e.g. Celery pool processes)
        inst.proc.wait()
        self._tell(f"-{inst.proc.pid}")
        if inst.reader is not None:
            inst.reader.join(timeout=5)
        self._spawn(inst)

    def _stop_supervising(self) -> None:
        self._supervisor_stop.set()
        thread, self._supervisor = self._supervisor, None
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=60)

    # ---- shutdown

    def hurry(self) -> None:
        """Make a stop in progress (or the next) kill the services at once instead of waiting for them."""
        self._hurry.set()

    def stop(self) -> None:
        """Stop every service, then the embedded servers. Safe to call twice, and from any thread."""
        self._supervisor_stop.set()  # before the lock: a supervisor pass in progress ends at its next check
        with self._lock:
            if self._stopped:
                return
            self._stopped = True
        self._stop_supervising()
        with self._lock:
            try:
                self._terminate(self.instances)
            finally:
                for server in (self.postgres, self.redis):
                    if server is not None:
                        try:
                            server.stop()
                            self._tell(f"-pg {server.folder.resolve()}" if server is self.postgres else f"-{server.pid}")
                        except Exception:  # the other one must still stop
                            log.exception("stopping %s failed", type(server).__name__)
                self.postgres = self.redis = None
                self._server_watches = {}
                self._stop_watchdog()

    def _terminate(self, instances: list[Instance]) -> None:
        for inst in instances:
            _signal_group(inst, signal.SIGTERM)
        deadline = time.monotonic() + self.stop_timeout_s
        for inst in instances:
            if inst.proc is None:
                continue
            while inst.proc.poll() is None and time.monotonic() < deadline and not self._hurry.is_set():
                time.sleep(0.05)
            if inst.proc.poll() is None and not self._hurry.is_set():
                log.warning("%s ignored SIGTERM for %.0fs; killing it", inst.label, self.stop_timeout_s)
            _signal_group(inst, signal.SIGKILL)  # stragglers and orphaned children of the group
            inst.proc.wait()
            self._tell(f"-{inst.proc.pid}")
            if inst.reader is not None:
                inst.reader.join(timeout=5)

    def __enter__(self) -> LocalStack:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    # ---- addresses

    @property
    def api_url(self) -> str:
        return self.instance("api").url

    @property
    def weight_server_url(self) -> str:
        return self.instance("weight-server").url


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

# shared/platform/logs.py's formats: text "12:00:00 W [trainer] message", json {"ts": ..., "level": "WARNING", ...}
LOG_HEAD = re.compile(r'^(?:\d\d:\d\d:\d\d ([DIWEC]) \[|\{"ts": [\d.]+, "level": "([DIWEC]))')
# Warnings nobody can act on: Celery run as root in a dev container, verl's optional engines (torchtitan,
# veomni, automodel) absent from a CPU install, verl setting up its platform again for each run it opens.
HARMLESS = re.compile(r"superuser privileges|engine is not available|Replacing already-initialised platform")
# What may follow a shown record as part of it: a traceback (its header, indented frames, chained-exception
# notes, the exception line) or an indented continuation. Anything else printed meanwhile is a library talking
# on its own (verl's "Monkey patch ..." prints, loading bars, which start with a carriage return, huggingface_hub's
# second copy of each warning through its own handler): the log file only.
PART_OF_RECORD = re.compile(r"^(?:[ \t]|$|Traceback \(|During handling of|The above exception|"
                            r"[A-Za-z_][\w.]*(?:Error|Exception|Exit|Interrupt|Timeout|Cancelled|Group)(?::|$))")
REPEAT_WINDOW_S = 60.0  # the same record within this long is shown once (a retry loop, one error per task)


class ConsoleFilter:
    """Which lines of one service's output the console shows: its warnings and errors (logged in the project's
    formats) with their tracebacks, minus HARMLESS ones, each once per REPEAT_WINDOW_S (the record with its
    timestamp left out). Info lines, raw library output and repeats stay in the log file only."""

    def __init__(self, clock: Callable[[], float] = time.monotonic):
        self.showing = False
        self.clock = clock
        self.seen: dict[str, float] = {}

    def __call__(self, line: str) -> bool:
        head = LOG_HEAD.match(line)
        if not head:
            return self.showing and bool(PART_OF_RECORD.match(line))
        self.showing = (head[1] or head[2]) in "WEC" and not HARMLESS.search(line)
        if self.showing:
            key, now = re.sub(r'^\d\d:\d\d:\d\d |"ts": [\d.]+, ', "", line), self.clock()
            self.showing = now - self.seen.get(key, -math.inf) >= REPEAT_WINDOW_S
            if self.showing:
                self.seen = {k: t for k, t in self.seen.items() if now - t < REPEAT_WINDOW_S} | {key: now}
        return self.showing


def _to_file(logger_name: str, path: Path) -> None:
    """Send a logger's records to `path`; only its errors still reach the console."""
    logger = logging.getLogger(logger_name)
    to_file = logging.FileHandler(path)
    to_file.setFormatter(logging.Formatter("%(asctime)s %(levelname)s [%(name)s] %(message)s"))
    errors = logging.StreamHandler(sys.stderr)
    errors.setLevel(logging.ERROR)
    errors.setFormatter(logging.getLogger().handlers[0].formatter)
    logger.handlers[:] = [to_file, errors]
    logger.propagate = False


def main() -> None:
    import typer

    def run(
        services: str = typer.Option(",".join(SERVICES), help="comma-separated services to start"),
        rollout_workers: int = typer.Option(1, min=0, help="rollout-worker processes"),
        env_workers: int = typer.Option(1, min=0, help="env-worker processes"),
        health_timeout_s: float = typer.Option(180.0, help="seconds to wait for every /healthz"),
        verbose: bool = typer.Option(False, "--verbose", "-v", help="echo every line of every service (default: "
                                     "their warnings and errors; everything is in $DATA_DIR/logs/)"),
    ) -> None:
        from shared.platform.logs import setup_logging

        setup_logging("stack", fmt=os.environ.get("LOG_FORMAT", "text"))
        logging.getLogger("alembic").setLevel(logging.WARNING)  # its per-plugin INFO lines drown the console
        env = {k: os.environ.get(k, d) for k, d in (("API_PORT", "8000"), ("WEIGHT_SERVER_PORT", "8001"))}
        stack = LocalStack(env=env, echo="all" if verbose else "important")
        (stack.data_dir / "logs").mkdir(parents=True, exist_ok=True)
        logging.captureWarnings(True)  # e.g. platformdirs' XDG_RUNTIME_DIR warning, through pgserver
        for noisy in ("pgserver", "py.warnings"):  # initdb / pg_ctl output, warnings: the log file
            _to_file(noisy, stack.data_dir / "logs" / "stack.log")
        stopping = StopOnSignal(stack)
        try:
            names = [s.strip() for s in services.split(",") if s.strip()]
            stack.start(names, counts={"rollout-worker": rollout_workers, "env-worker": env_workers})
            stack.wait_healthy(health_timeout_s, interrupted=stopping.requested)
            if not stopping.requested.is_set():
                stack.supervise()
                log.info("all services healthy%s; restarting any that exits; Ctrl-C stops everything",
                         _api_hint(stack))
            while not stopping.requested.wait(1.0):
                pass
        finally:
            stack.stop()
            stopping.ignore_further()
            log.info("stopped")

    typer.run(run)


def _api_hint(stack: LocalStack) -> str:
    """Where the API is, and how the CLI in another terminal finds it: `flywheel` reads FLYWHEEL_API_URL, else
    API_PORT, so a stack on a port other than 8000 needs one of them exported there too."""
    if not any(i.name == "api" for i in stack.instances):
        return ""
    url = stack.api_url
    return f"; API at {url}" + ("" if url.endswith(":8000") else f" (CLI: export FLYWHEEL_API_URL={url})")


SAME_SIGNAL_S = 0.5  # a signal this soon after the first is the same request, delivered twice (env: STACK_SAME_SIGNAL_S)


class StopOnSignal:
    """Signal handling of the console entry: the first SIGINT/SIGTERM/SIGHUP/SIGQUIT asks for a stop (the main
    thread notices and runs stack.stop()); any later one, past SAME_SIGNAL_S, makes that stop kill the services
    at once. A handler never raises, so no signal can interrupt stop() half-way and leave children behind."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT)

    def __init__(self, stack: LocalStack):
        self.stack = stack
        self.requested = threading.Event()
        self.first_at = 0.0
        self.same_signal_s = float(os.environ.get("STACK_SAME_SIGNAL_S", SAME_SIGNAL_S))
        for sig in self.SIGNALS:
            signal.signal(sig, self._handle)

    def ignore_further(self) -> None:
        # Everything is stopped; Python would restore the default handlers while it exits, and a late signal
        # would then end the process with that signal instead of 0.
        for sig in self.SIGNALS:
            signal.signal(sig, signal.SIG_IGN)

    def _handle(self, signum: int, _frame) -> None:
        name = signal.Signals(signum).name
        if not self.requested.is_set():
            self.first_at = time.monotonic()
            self.requested.set()
            log.info("%s: stopping every service (another signal kills them at once)", name)
        elif time.monotonic() - self.first_at < self.same_signal_s:
            log.debug("%s: the first stop request, delivered twice", name)
        else:
            self.stack.hurry()
            log.warning("%s again: killing the remaining services now", name)


if __name__ == "__main__":
    main()
