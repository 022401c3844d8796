"""Jobs worker settings (environment variables; REDIS_URL is the Celery broker, DATABASE_URL the job store)."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field

from shared.platform.settings import ServiceSettings


class JobsSettings(ServiceSettings):
    service_name: str = "jobs"
    jobs_concurrency: int = Field(2, ge=1, le=64, description="jobs run at once by this worker (threads)")
    jobs_pool: Literal["threads", "solo", "prefork"] = Field("threads", description="Celery execution pool")
    jobs_beat: bool = Field(False, description="also run the periodic schedule (GC, tracking); one worker only")
    gc_interval_s: float = Field(3600.0, gt=0, description="period of scheduled GC, seconds (with JOBS_BEAT)")
    keep_checkpoints: int = Field(3, ge=1, description="scheduled GC: newest checkpoints kept per finished run")
    weight_server_url: str = Field("http://127.0.0.1:8001", description="WEIGHT_SERVER_URL: GC asks it to "
                                   "delete a finished run's older checkpoints")
    exports_dir: Path | None = Field(None, description="where parquet exports go; default $DATA_DIR/exports")
    wandb_project: str | None = Field(None, description="WANDB_PROJECT: log run metrics to W&B (off when unset)")
    mlflow_tracking_uri: str | None = Field(None, description="MLFLOW_TRACKING_URI: log run metrics to MLflow")
    check_model_paths: bool = Field(True, description="CHECK_MODEL_PATHS: an eval job checks the model folder "
                                    "exists here (false when this worker does not share the rollout workers' files)")
    tracking_interval_s: float = Field(30.0, gt=0, description="period of metric syncing to W&B/MLflow, seconds")

    def resolved_exports_dir(self) -> Path:
        return (self.exports_dir or self.data_dir / "exports").resolve()
