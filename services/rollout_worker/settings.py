"""rollout-worker settings (environment variables, e.g. MAX_CONCURRENCY=128)."""

from __future__ import annotations

from pathlib import Path

from pydantic import Field, model_validator

from shared.platform.settings import ServiceSettings


class RolloutWorkerSettings(ServiceSettings):
    service_name: str = "rollout-worker"
    max_concurrency: int = Field(64, ge=1, description="trajectories (tasks) run at once, count")
    read_block_ms: int = Field(200, ge=1, description="longest blocking read of rollout.tasks, milliseconds")
    claim_idle_ms: int = Field(30_000, ge=100, description="a task pending this long at a silent worker is "
                               "reclaimed, milliseconds; live workers refresh their own every claim_idle_ms/3")
    max_deliveries: int = Field(5, ge=1, description="deliveries of one task before it is dead-lettered")
    env_reply_margin_s: float = Field(5.0, ge=0, description="added to an env call's timeout before the session "
                                      "counts as lost (env worker dead), seconds")
    error_retries: int = Field(1, ge=0, description="re-runs of an episode that ended in ERROR, count")
    drain_timeout_s: float = Field(15.0, ge=0, description="on stop, wait this long for running trajectories; "
                                   "the rest stay unacknowledged and are reclaimed by other workers, seconds")
    hf_batch_wait_ms: float = Field(5.0, ge=0, description="hf engine: how long requests gather into one "
                                    "batch, milliseconds")
    run_idle_s: float = Field(600.0, gt=0, description="a run with no task on this worker for this long has its "
                              "engine, model and tokenizer released (built again if its tasks return), seconds")
    gateway_host: str = Field("127.0.0.1", description="address the agent-program gateway binds; 0.0.0.0 to "
                              "serve external agent programs on other hosts")
    gateway_port: int = Field(0, ge=0, description="agent-program gateway port; 0 picks a free one (reported in "
                              "/healthz and the heartbeat as gateway_port)")
    gateway_public_host: str | None = Field(None, description="host name agent programs elsewhere (and the API, "
                                            "forwarding claims) reach this worker by; default gateway_host, or "
                                            "this machine's host name when gateway_host is 0.0.0.0")
    gateway_token: str | None = Field(None, description="GATEWAY_TOKEN: bearer token external agent programs "
                                      "need to claim sessions (POST /v1/runs/<run_id>/sessions); unset = none")
    agent_memory_bytes: int = Field(4 << 30, ge=64 << 20, description="address-space limit of a managed agent "
                                    "program's process (RLIMIT_AS), bytes")
    checkpoint_cache_dir: Path | None = Field(
        None, description="CHECKPOINT_CACHE_DIR: where checkpoints fetched over HTTP are kept (not used when the "
        "weight server's volume is mounted: those are read in place); default DATA_DIR/rollout-weights")

    relay_host: str | None = Field(
        None, description="RELAY_HOST: the address other rollout workers reach this one at. Set, checkpoint files "
        "fetched over HTTP come through the weight server's relay chain (each worker passes what it verified on to "
        "the next, so the server sends each version once) and this worker serves them on HEALTH_PORT, which must "
        "then be fixed (not 0). Such a worker is remote from the weight server: it never reads the server's volume")

    @model_validator(mode="after")
    def _relay_needs_a_port(self) -> RolloutWorkerSettings:
        if self.relay_host and not self.health_port:
            raise ValueError("RELAY_HOST is set but HEALTH_PORT is 0: other workers need a fixed port to fetch "
                             "relayed checkpoints from; set HEALTH_PORT")
        return self

    @property
    def relay_url(self) -> str | None:
        return f"http://{self.relay_host}:{self.health_port}" if self.relay_host else None

    @property
    def weights_cache(self) -> Path:
        return self.checkpoint_cache_dir or self.data_dir / "rollout-weights"
