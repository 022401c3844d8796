"""API settings (environment variables; see ServiceSettings for REDIS_URL, DATABASE_URL, DATA_DIR, ...)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, model_validator

from shared.contracts.run_config import EngineConfig
from shared.platform.settings import ServiceSettings


class TinkerRates(BaseModel):
    """One base model's prices in USD (None: not priced): tokens per million, storage per GB-month (720 GB-hours)."""
    model_config = ConfigDict(extra="forbid")

    training: float | None = Field(None, ge=0)
    sampling_prefill: float | None = Field(None, ge=0)
    sampling_prefill_cached: float | None = Field(None, ge=0, description="unset: sampling_prefill's")
    sampling_sample: float | None = Field(None, ge=0)
    storage_gb_month: float | None = Field(None, ge=0)


class TinkerRateCard(BaseModel):
    """The operator's prices for Tinker usage: `default` for every base model, `models` per base model name (a
    rate a model's entry leaves unset is the default's)."""
    model_config = ConfigDict(extra="forbid")

    default: TinkerRates = Field(default_factory=TinkerRates)
    models: dict[str, TinkerRates] = Field(default_factory=dict)

    def rate(self, base_model: str | None, kind: str) -> float | None:
        """USD per million tokens of usage `kind`, or per GB-month for `storage_gb_month`; None: not priced."""
        for rates in (self.models.get(base_model or ""), self.default):
            if rates is not None and (value := getattr(rates, kind)) is not None:
                return value
        if kind == "sampling_prefill_cached":  # cached prefill costs what prefill does unless priced apart
            return self.rate(base_model, "sampling_prefill")
        return None


class ApiSettings(ServiceSettings):
    service_name: str = "api"
    api_host: str = Field("0.0.0.0", description="interface uvicorn binds")
    api_port: int = Field(8000, ge=0, le=65535, description="HTTP port (API_PORT); 0 picks a free port")
    api_token: str | None = Field(
        None, description="API_TOKEN: one bearer token with every scope (local/dev); others live in api_tokens"
    )
    sql_timeout_s: float = Field(30.0, gt=0, le=600, description="statement timeout of POST /v1/sql, seconds")
    sql_database_url: str | None = Field(
        None, description="SQL_DATABASE_URL: a LOGIN role that is a member of flywheel_reader, used for POST /v1/sql"
        " (safest for untrusted users); unset: DATABASE_URL's user switches to flywheel_reader (SET ROLE)",
    )
    sql_max_rows: int = Field(10_000, ge=1, description="rows returned by POST /v1/sql at most")
    max_upload_mb: int = Field(200, ge=1, description="largest dataset upload, MiB")
    check_model_paths: bool = Field(
        True, description="CHECK_MODEL_PATHS: refuse runs whose local model folder does not exist here (relative "
        "paths resolve against the API's working directory); false when the API does not see the workers' files")
    run_command_wait_s: float = Field(
        10.0, gt=0, le=120, description="how long POST /v1/runs and a pause, resume or stop wait for the "
        "controller to apply them before answering 503 (nothing changed), seconds")
    job_request_wait_s: float = Field(
        10.0, gt=0, le=120, description="how long a route that queues a job waits for the jobs service to store it "
        "before answering 503 (nothing queued), seconds")
    dataset_job_wait_s: float = Field(
        30.0, ge=0, le=600, description="how long an upload (POST /v1/datasets) or a DELETE waits for its job "
        "(the jobs service stores datasets) before answering 202 with the job to follow, seconds; 0: at once")
    page_limit_max: int = Field(1000, ge=1, description="largest `limit` a list route accepts")
    jaeger_ui_url: str | None = Field(
        None, description="JAEGER_UI_URL: where users open Jaeger (http://127.0.0.1:16686); the trajectory page "
        "links each unit's trace there (docs/observability.md)")
    gateway_token: str | None = Field(
        None, description="GATEWAY_TOKEN: the rollout workers' token for claiming agent sessions, sent when "
        "POST /v1/runs/{id}/sessions forwards a claim to them (unset when they need none)")

    tinker_base_models: str | None = Field(
        None, description="TINKER_BASE_MODELS: the base models the Tinker API offers, comma-separated local paths or "
        "hub ids; unset: every model folder under DATA_DIR/models, by folder name (docs/tinker.md)")
    weight_server_url: str = Field(
        "http://127.0.0.1:8001", description="WEIGHT_SERVER_URL: where Tinker exports (save_weights_external) are "
        "kept; the API streams them to the holders of signed URLs")
    signed_url_ttl_s: int = Field(3600, ge=60, le=7 * 86400, description="SIGNED_URL_TTL_S: how long a signed "
                                  "download URL (get_external_weights_urls) is valid")
    tinker_jwt_ttl_s: int = Field(3600, ge=0, le=86400, description="TINKER_JWT_TTL_S: how long a JWT the Tinker "
                                  "SDK exchanges its key for is valid (it refreshes at half that); 0: no exchange, "
                                  "the SDK sends its tml- key with every request")
    tinker_rate_card: TinkerRateCard = Field(
        default_factory=TinkerRateCard, description="TINKER_RATE_CARD: prices of Tinker usage in JSON, e.g. "
        '{"default": {"training": 0.4, "sampling_prefill": 0.1, "sampling_sample": 0.3, "storage_gb_month": 0.02}, '
        '"models": {"my-model": {"training": 0.8}}} (USD per million tokens, storage per GB-month); unset: '
        "usage reports carry no costs")
    tinker_engine: EngineConfig = Field(
        default_factory=EngineConfig, description="TINKER_ENGINE: the rollout workers' engine for Tinker samples, "
        'as a run\'s `engine` in JSON (e.g. {"type": "vllm", "device": "cuda"}); default: hf on cpu')

    @model_validator(mode="after")
    def _token(self) -> ApiSettings:
        if self.api_token is not None and len(self.api_token) < 8:
            raise ValueError("API_TOKEN must be at least 8 characters (or unset it and create tokens with the CLI)")
        self.health_host, self.health_port = self.api_host, self.api_port  # one HTTP server: the API serves /healthz
        return self
