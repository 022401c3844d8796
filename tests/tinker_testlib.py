"""A Tinker stack for tests: API (with its controller), trainer, weight server and rollout worker on real
Postgres/Redis, the tiny model offered as a base. `tinker_stack(...)` yields a `TinkerStack`."""

from __future__ import annotations

import contextlib
import signal
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import redis
from api_testlib import ADMIN_TOKEN, LiveApi, running_api, service_env
from trainer_testlib import WeightServer

from tests.support.procs import start_service, stop, wait_heartbeat, wait_http
from tests.support.tiny_model import build_tiny_model

BASE = "tiny-qwen2"


@dataclass
class TinkerStack:
    api: LiveApi
    data_dir: Path
    database_url: str
    redis_url: str
    ws: WeightServer
    trainer: object = None
    rollout: object = None
    api_env: dict = field(default_factory=dict)

    @property
    def url(self) -> str:
        return self.api.url

    @property
    def token(self) -> str:
        return self.api.token

    @property
    def model_dir(self) -> Path:
        return self.data_dir / "models" / BASE

    def start_trainer(self, worker_id: str = "trainer-tinker"):
        """The stack's trainer (another `worker_id`: one more trainer of the fleet, with the same STATE_DIR, which
        the caller stops)."""
        n = len(list(self.data_dir.glob("trainer*.log")))
        proc = start_service("services.trainer.main", log=self.data_dir / f"trainer{n}.log",
                             **service_env(self.database_url, self.redis_url, self.data_dir,
                                           worker_id=worker_id, runs_poll_s="0.5", tinker_sweep_s="1",
                                           weight_server_url=self.ws.url, weights_dir=self.ws.env["WEIGHTS_DIR"],
                                           master_port=None, master_addr=None, rank=None, world_size=None))
        wait_heartbeat(self.redis_url, "trainer", worker_id, proc, timeout_s=180)
        if worker_id == "trainer-tinker":
            self.trainer = proc
        return proc

    def kill_trainer(self) -> None:
        self.trainer.send_signal(signal.SIGKILL)
        self.trainer.wait(30)

    def start_rollout(self):
        self.rollout = start_service("services.rollout_worker.main", log=self.data_dir / "rollout.log",
                                     **service_env(self.database_url, self.redis_url, self.data_dir,
                                                   worker_id="rollout-tinker", drain_timeout_s="1"))
        wait_heartbeat(self.redis_url, "rollout-worker", "rollout-tinker", self.rollout, timeout_s=120)
        return self.rollout

    def client(self):
        return self.api.client()

    def restart_api(self) -> None:
        """Kill the API process (SIGKILL) and start it again on the same port."""
        self.api.proc.send_signal(signal.SIGKILL)
        self.api.proc.wait(30)
        port = self.api.url.rsplit(":", 1)[1]
        self.api.proc = start_service("services.api.main", log=self.data_dir / "api-restarted.log",
                                      **service_env(self.database_url, self.redis_url, self.data_dir, API_PORT=port,
                                                    API_TOKEN=ADMIN_TOKEN, API_HOST="127.0.0.1", **self.api_env))
        wait_http(self.api.url + "/healthz", self.api.proc)


@contextlib.contextmanager
def tinker_stack(database_url: str, redis_url: str, data_dir: Path, **api_env: str) -> Iterator[TinkerStack]:
    """The stack with the tiny model at DATA_DIR/models/tiny-qwen2 (offered as `tiny-qwen2` unless `api_env`
    sets TINKER_BASE_MODELS)."""
    build_tiny_model(data_dir / "models" / BASE)
    redis.Redis.from_url(redis_url).delete("tinker.requests", "tinker.samples")
    ws = WeightServer(redis_url, database_url, data_dir / "weights", keep_last=10).start()
    api_env = {"WEIGHT_SERVER_URL": ws.url, **api_env}  # where the API streams exports from
    stack = None
    try:
        with running_api(database_url, redis_url, data_dir, **api_env) as api:
            stack = TinkerStack(api, data_dir, database_url, redis_url, ws, api_env=api_env)
            stack.start_trainer()
            stack.start_rollout()
            yield stack
    finally:
        for proc in (getattr(stack, "trainer", None), getattr(stack, "rollout", None)):
            if proc is not None:
                stop(proc)
        ws.stop()
