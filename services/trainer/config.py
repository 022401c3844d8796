"""Trainer settings (environment variables). What to train comes from each run's RunConfig in Postgres."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, model_validator

from shared.settings import ServiceSettings


class TrainerSettings(ServiceSettings):
    service_name: str = "trainer"
    weight_server_url: str = Field("http://127.0.0.1:8001", description="where checkpoints are published")
    weights_dir: Path | None = Field(
        None, description="the weight server's volume when co-located (publish by moving a staging folder); "
        "unset: upload every file over HTTP")
    state_dir: Path | None = Field(None, description="trainer checkpoints (model + optimizer); default $DATA_DIR/trainer")
    device: Literal["cpu", "cuda"] = Field("cpu", description="where verl's FSDP2 engine runs")
    dtype: Literal["fp32", "bf16"] = Field("fp32", description="parameter dtype (CPU: fp32)")
    micro_batch_size: int = Field(64, ge=1, description="sequences per forward/backward pass")
    keep_checkpoints: int = Field(2, ge=1, description="trainer checkpoints kept per run")
    runs_poll_s: float = Field(0.5, gt=0, description="how often the runs table is read, seconds")
    lease_ttl_s: float = Field(15.0, gt=0, description="a run's trainer lease (shared/leases.py) expires this long after renewal")
    read_block_ms: int = Field(200, ge=1, description="blocking read on results.accepted, milliseconds")
    read_batch: int = Field(256, ge=1, description="stream entries per read")
    publish_timeout_s: float = Field(600.0, gt=0, description="total budget to publish one version")
    delta_zstd_level: int = Field(
        1, ge=-7, le=22, description="zstd level of weight deltas (1: fast and ~2.4x smaller than the changed "
        "elements' raw bytes; negative: zstd's faster levels, for a co-located weight server where bytes are cheap)")
    best_metric: str = Field("reward_mean", description="metric the weight server keeps the best version by")

    @model_validator(mode="after")
    def _defaults(self) -> TrainerSettings:
        self.state_dir = self.state_dir or self.data_dir / "trainer"
        return self
