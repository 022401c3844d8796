"""Trainer settings (environment variables). What to train comes from each run's RunConfig in Postgres."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, model_validator

from shared.platform.settings import ServiceSettings


class TrainerSettings(ServiceSettings):
    service_name: str = "trainer"
    weight_server_url: str = Field("http://127.0.0.1:8001", description="where checkpoints are published")
    weights_dir: Path | None = Field(
        None, description="the weight server's volume when co-located (publish by moving a staging folder); "
        "unset: upload every file over HTTP")
    state_dir: Path | None = Field(None, description="trainer checkpoints (model + optimizer); default $DATA_DIR/trainer")
    device: Literal["cpu", "cuda"] = Field("cpu", description="where verl's FSDP2 engine runs")
    dtype: Literal["fp32", "bf16"] = Field("fp32", description="parameter dtype (CPU: fp32)")
    micro_batch_size: int = Field(
        64, ge=1, description="sequences per forward/backward pass when micro_batch_tokens is 0 (padded path)")
    remove_padding: bool = Field(
        True, description="pack each micro-batch's sequences end to end (verl's use_remove_padding): no compute "
        "on padding, attention still per sequence; false: every micro-batch padded to its longest sequence")
    micro_batch_tokens: int | None = Field(
        None, ge=0, description="token budget per micro-batch (verl's dynamic batch size: sequences whose lengths "
        "sum to at most this; a longer one alone); 0: micro_batch_size rows instead; unset: 16384 on cuda "
        "(bench/results/gpu_smoke.json), 2048 on cpu (bench/results/train.json, step part)")
    attn_implementation: Literal["auto", "sdpa", "flex_attention", "flash_attention_2"] = Field(
        "auto", description="HF attention kernel; auto: flash_attention_2 where flash-attn is installed, else "
        "flex_attention for packed sequences on cuda (per-sequence blocks; sdpa's dense mask over a packed "
        "micro-batch cost 1.8x per step on an H100), sdpa otherwise")
    compile_layers: bool = Field(
        False, description="each decoder layer's forward through torch.compile (FSDP2's hooks stay outside): the "
        "same step, 1.02x (full-length) to 1.10x (RL-shaped) faster on an H100 for a 0.5B model, after a compile "
        "of tens of seconds per new shape (bench/results/gpu_smoke.json, compile_and_profile)")
    log_prob_kernel: Literal["auto", "torch", "chunked_triton"] = Field(
        "auto", description="per-token log-probs over the vocabulary: verl's chunked kernel with its fp32 math "
        "(torch) or with that math in Triton over bf16 logits (chunked_triton: 1.45x the step of a 0.5B model on an "
        "H200, bench/results/gpu_check.json); auto: chunked_triton on cuda where Triton is installed, else torch")
    liger_kernels: bool = Field(
        False, description="cuda: liger-kernel's fused RMSNorm, SwiGLU and RoPE in the model (needs the liger-kernel "
        "package; 1.1x on packed RL-shaped batches, 0.92x on full-length padded ones, bench/results/gpu_check.json)")
    keep_checkpoints: int = Field(2, ge=1, description="trainer checkpoints kept per run")
    runs_poll_s: float = Field(0.5, gt=0, description="how often the runs table is read, seconds")
    tinker_sweep_s: float = Field(60.0, gt=0, description="how often expired Tinker checkpoints (deleted, or past "
                                  "their ttl) are removed from STATE_DIR and Redis, seconds")
    lease_ttl_s: float = Field(15.0, gt=0, description="a run's trainer lease (shared/platform/leases.py) expires this long after renewal")
    read_block_ms: int = Field(200, ge=1, description="blocking read on results.accepted, milliseconds")
    read_batch: int = Field(256, ge=1, description="stream entries per read")
    publish_timeout_s: float = Field(600.0, gt=0, description="total budget to publish one version")
    delta_zstd_level: int = Field(
        1, ge=-7, le=22, description="zstd level of weight deltas (1: fast and ~2.4x smaller than the changed "
        "elements' raw bytes; negative: zstd's faster levels, for a co-located weight server where bytes are cheap)")
    delta_on_device: bool = Field(
        True, description="cuda: export each version onto rank 0's GPU and keep it there as the next delta's base, "
        "so the diff runs next to the weights and only the changes and changed tensors cross to the host (0.23 s "
        "vs 1.45 s for the host kernel on two 0.99 GB versions on an H100, bench/results/gpu_smoke.json); costs one "
        "copy of the exported weights in GPU memory. false, or cpu: the diff runs on the host")
    best_metric: str = Field("reward_mean", description="metric the weight server keeps the best version by")
    # Server-wide tracker defaults: each one set turns its tracker on for every run, and fills what a run's
    # `tracking` leaves unset (services/trainer/tracking.py).
    tracking_wandb_project: str | None = Field(None, description="W&B project of every run")
    tracking_wandb_entity: str | None = Field(None, description="W&B team or user")
    tracking_wandb_mode: Literal["online", "offline"] | None = Field(None, description="W&B mode; default WANDB_MODE, else online")
    tracking_mlflow_tracking_uri: str | None = Field(None, description="MLflow server or store of every run")
    tracking_mlflow_experiment: str | None = Field(None, description="MLflow experiment; default flywheel")
    tracking_tensorboard_dir: Path | None = Field(None, description="TensorBoard event files of every run")
    tracking_hung_after_s: float = Field(60.0, gt=0, description="a tracker call in progress this long is reported "
                                         "as hung in the run's tracker warning (its later versions wait for it)")
    tracking_flush_s: float = Field(30.0, ge=0, description="how long a stopping trainer waits for its trackers' "
                                    "last calls (W&B and TensorBoard flush their files)")

    @model_validator(mode="after")
    def _defaults(self) -> TrainerSettings:
        self.state_dir = self.state_dir or self.data_dir / "trainer"
        if self.micro_batch_tokens is None:
            self.micro_batch_tokens = 16384 if self.device == "cuda" else 2048
        return self

    def engine_options(self) -> dict:
        """The PolicyEngine keywords these settings choose (micro-batching, padding removal, attention)."""
        # verl's fused log-prob kernel everywhere: the trainer process holds no other model of the class it patches
        return {"micro_batch_size": self.micro_batch_size, "remove_padding": self.remove_padding,
                "fused_backend": resolve_log_prob_kernel(self.log_prob_kernel, self.device),
                "use_liger": self.liger_kernels and self.device == "cuda",
                "micro_batch_tokens": self.micro_batch_tokens or None, "compile_layers": self.compile_layers,
                "attn_implementation": resolve_attention(self.attn_implementation, self.device, self.remove_padding)}


def resolve_log_prob_kernel(name: str, device: str) -> str:
    if name != "auto":
        return name
    import importlib.util

    return "chunked_triton" if device == "cuda" and importlib.util.find_spec("triton") is not None else "torch"


def resolve_attention(name: str, device: str, packed: bool) -> str:
    if name != "auto":
        return name
    if device == "cuda":
        import importlib.util

        if importlib.util.find_spec("flash_attn") is not None:
            return "flash_attention_2"
        return "flex_attention" if packed else "sdpa"
    return "sdpa"
