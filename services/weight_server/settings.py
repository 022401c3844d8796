"""Weight-server settings (environment variables, pydantic-settings)."""

from __future__ import annotations

from pathlib import Path

from pydantic import Field, model_validator

from shared.platform.settings import ServiceSettings


class WeightServerSettings(ServiceSettings):
    service_name: str = "weight-server"
    weight_server_port: int = Field(8001, description="HTTP port for uploads, downloads, /healthz and /metrics")
    weights_dir: Path | None = Field(None, description="checkpoint volume; default $DATA_DIR/weights")
    public_url: str | None = Field(
        None, description="base URL announced in WeightsPublished.uri; default http://127.0.0.1:<port>"
    )
    keep_last: int = Field(3, ge=1, description="versions kept per run besides the best one")
    snapshot_every: int = Field(
        10, ge=1, description="a full snapshot every N versions, deltas (only what changed) in between; 1: always full")
    announce_path: bool = Field(True, description="announce the shared-volume path for co-located readers")
    # The co-located trainer declares each staged file's sha256: a full snapshot's files hashed as read back
    # after it wrote them, a delta file hashed from the bytes in memory before it wrote them. Trusting the
    # declaration saves a read of every checkpoint; re-hashing catches what went wrong between the trainer's
    # write and this server's rename. HTTP uploads are always hashed.
    verify_staging: bool = Field(
        False, description="re-hash files a co-located trainer publishes by staging path instead of trusting the "
        "sha256 it declares (one more read of the checkpoint per version; HTTP uploads are always hashed)")

    @model_validator(mode="after")
    def _defaults(self) -> WeightServerSettings:
        self.weights_dir = self.weights_dir or self.data_dir / "weights"
        self.public_url = (self.public_url or f"http://127.0.0.1:{self.weight_server_port}").rstrip("/")
        self.health_port = self.weight_server_port  # one HTTP server: the API and /healthz share the port
        return self
