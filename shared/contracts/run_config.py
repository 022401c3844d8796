"""The typed run config: the body of `POST /v1/runs`, stored in `runs.config`, read by every service.

Every field says its unit. Unknown fields are rejected (`extra="forbid"`) so a typo fails with the field's
name instead of silently using a default. Cross-field checks raise ValueError saying how to fix the config.
"""

from __future__ import annotations

from typing import Any, Literal, get_args

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from shared.contracts.registry import MODEL_CODE_ENVS, REGISTRIES, import_path_for, resolve
from shared.sdk.types import TerminationReason

# How an env runs model-written code (the env worker checks at start that its mode can run there).
SandboxMode = Literal["namespaces", "container", "none"]
SANDBOX_MODES: tuple[str, ...] = get_args(SandboxMode)
DEFAULT_SANDBOX_MODE: SandboxMode = "namespaces"

# verl 0.9.1 names (verl.trainer.ppo.core_algos registries); checked here so a typo is a 4xx, not a trainer crash.
ADV_ESTIMATORS = (
    "gae", "grpo", "reinforce_plus_plus", "reinforce_plus_plus_baseline", "remax", "rloo", "opo",
    "grpo_passk", "gpg",
)
POLICY_LOSSES = ("vanilla", "gspo", "sapo", "cispo", "clip_cov", "kl_cov", "dppo_tv", "dppo_kl")
LOSS_AGG_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")
# verl's rollout rejection sampling modes (verl.trainer.ppo.rollout_corr_helper.SUPPORTED_ROLLOUT_RS_OPTIONS)
ROLLOUT_RS_OPTIONS = ("token_k1", "token_k2", "token_k3", "seq_sum_k1", "seq_sum_k2", "seq_sum_k3", "seq_mean_k1",
                      "seq_mean_k2", "seq_mean_k3", "seq_max_k2", "seq_max_k3")
GROUP_ESTIMATORS = ("grpo", "rloo", "reinforce_plus_plus_baseline", "opo", "grpo_passk", "gpg")


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ComponentSpec(_Strict):
    """An agent, env or workflow: a registered name (`math`) or an import path (`my_pkg.envs:MyEnv`)."""

    name: str
    args: dict[str, Any] = Field(default_factory=dict, description="keyword arguments for the constructor")


class EngineConfig(_Strict):
    type: Literal["hf", "vllm", "openai"] = "hf"
    base_url: str | None = Field(None, description="OpenAI-compatible server, e.g. http://host:8000/v1 (openai)")
    api_key_env: str | None = Field(None, description="name of the env var holding the server's API key")
    device: str = Field("cpu", description="hf: torch device")
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    weights_dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto", description="dtype the trainer publishes weights in (what the engines receive; deltas are taken "
        "in it); auto: the model's own torch_dtype from its config.json (bfloat16 for most released models)")
    max_batch_size: int = Field(32, ge=1, description="hf: requests batched into one generate call")
    gpu_memory_utilization: float = Field(0.85, gt=0, le=1, description="vllm")
    tensor_parallel_size: int = Field(1, ge=1, description="vllm")
    max_model_len: int | None = Field(None, ge=16, description="vllm: longest prompt + response served (sizes the "
                                      "KV cache); default the model's context length")
    enforce_eager: bool = Field(False, description="vllm: skip torch.compile and CUDA graphs (start-up ~30 s "
                                "faster on CPU, slower decoding on GPU)")
    max_loras: int = Field(4, ge=1, description="vllm, LoRA runs: adapters in one batch; beyond that vLLM evicts "
                           "the least recently used adapter and reloads it from disk when its run asks again")
    max_lora_rank: int = Field(64, ge=1, le=256, description="vllm, LoRA runs: largest adapter rank served")
    request_timeout_s: float = Field(120.0, gt=0, description="one generation request")
    partial_chunk_tokens: int = Field(32, ge=1, description="hf, partial_rollout runs: tokens decoded between two "
                                      "chances for a new version to take over")
    max_retries: int = Field(3, ge=0, description="transient inference errors retried before INFRA_ERROR")


class SamplingConfig(_Strict):
    temperature: float = Field(1.0, ge=0)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(-1, description="-1 disables")
    stop: list[str] = Field(default_factory=list)


class LoRAConfig(_Strict):
    """Train a LoRA adapter on the frozen base `model` (PEFT's LoRA: W + alpha/rank * B A on each target module).
    The reference policy for KL is the base with the adapter switched off; versions are the adapter alone."""

    rank: int = Field(..., ge=1, le=256, description="rank r of each adapter's A (r x in) and B (out x r)")
    alpha: int = Field(16, ge=1, description="scaling numerator: the update is alpha / rank * B A")
    dropout: float = Field(0.0, ge=0, lt=1, description="dropout on the adapter's input while training")
    target_modules: list[str] | Literal["all-linear"] = Field(
        "all-linear", description="module names to adapt, matched on the end of each module's path (q_proj, "
        "v_proj, ...), or all-linear: every linear layer but the output layer")

    @field_validator("target_modules")
    @classmethod
    def _targets(cls, v: list[str] | str) -> list[str] | str:
        if isinstance(v, list) and (not v or not all(name.strip() for name in v)):
            raise ValueError("name at least one module (e.g. [\"q_proj\", \"v_proj\"]) or use \"all-linear\"")
        return v

    def verl_fields(self) -> dict:
        """verl's LoRA fields of its HF model config."""
        return {"lora_rank": self.rank, "lora_alpha": self.alpha, "target_modules": self.target_modules}


# An episode cut by the context window never reached its answer: its tokens get no loss unless a run asks.
MASKED_TERMINATIONS = (TerminationReason.CONTEXT_EXCEEDED.value,)


class AlgorithmConfig(_Strict):
    adv_estimator: str = "grpo"
    policy_loss: str = "vanilla"
    loss_agg_mode: str = "token-mean"
    norm_adv_by_std_in_grpo: bool = True
    gamma: float = Field(1.0, ge=0, le=1)
    lam: float = Field(1.0, ge=0, le=1, description="GAE lambda")
    clip_ratio_low: float = Field(0.2, ge=0)
    clip_ratio_high: float = Field(0.2, ge=0)
    clip_ratio_c: float = Field(3.0, gt=1, description="dual-clip PPO lower bound")
    kl_coef: float = Field(0.0, ge=0, description="KL-to-reference loss weight; 0 disables the reference model")
    kl_penalty: str = "low_var_kl"
    entropy_coeff: float = Field(0.0, ge=0)
    lr: float = Field(1e-6, gt=0, description="actor learning rate")
    critic_lr: float = Field(1e-5, gt=0, description="critic learning rate (gae only)")
    weight_decay: float = Field(0.0, ge=0)
    grad_clip: float = Field(1.0, gt=0)
    ppo_epochs: int = Field(1, ge=1)
    ppo_mini_batches: int = Field(1, ge=1, description="optimizer steps per batch = ppo_epochs * mini batches")
    is_cap: float = Field(2.0, gt=0, description="truncated importance-sampling cap on behaviour/current ratio")
    rollout_rs: str | None = Field(
        None, description="verl's rollout rejection sampling: mask the tokens / sequences whose behaviour/current "
                          "ratio is out of bounds, e.g. 'token_k1' or 'seq_mean_k1' (verl's names); None: off")
    rollout_rs_threshold: str | float | None = Field(
        None, description="bounds for `rollout_rs`, verl's format: a float (upper) or 'lower_upper'")
    dynamic_sampling: bool = Field(False, description="drop groups whose rewards are all equal and refill")
    mask_termination: list[str] = Field(
        default_factory=lambda: list(MASKED_TERMINATIONS),
        description="termination reasons whose trajectories are stored and keep their reward in the group but "
                    "get no loss (user-code errors and infrastructure failures are never trained on anyway); "
                    "e.g. add 'response_truncation' to mask overlong samples, or [] to train on context_exceeded")
    lora: LoRAConfig | None = Field(None, description="train a LoRA adapter instead of the full weights")

    @field_validator("adv_estimator")
    @classmethod
    def _est(cls, v: str) -> str:
        if v not in ADV_ESTIMATORS:
            raise ValueError(f"unknown advantage estimator {v!r}; choose one of {', '.join(ADV_ESTIMATORS)}")
        return v

    @field_validator("policy_loss")
    @classmethod
    def _loss(cls, v: str) -> str:
        if v not in POLICY_LOSSES:
            raise ValueError(f"unknown policy loss {v!r}; choose one of {', '.join(POLICY_LOSSES)}")
        return v

    @field_validator("loss_agg_mode")
    @classmethod
    def _agg(cls, v: str) -> str:
        if v not in LOSS_AGG_MODES:
            raise ValueError(f"unknown loss_agg_mode {v!r}; choose one of {', '.join(LOSS_AGG_MODES)}")
        return v

    @field_validator("mask_termination")
    @classmethod
    def _mask(cls, v: list[str]) -> list[str]:
        valid = [r.value for r in TerminationReason]
        if unknown := [r for r in v if r not in valid]:
            raise ValueError(f"unknown termination reason(s) {', '.join(map(repr, unknown))}; choose from "
                             f"{', '.join(valid)}")
        return v

    @model_validator(mode="after")
    def _rejection(self) -> AlgorithmConfig:
        for option in (self.rollout_rs or "").split(","):
            if option and option.strip() not in ROLLOUT_RS_OPTIONS:
                raise ValueError(f"unknown rollout_rs {option!r}; choose from {', '.join(ROLLOUT_RS_OPTIONS)} "
                                 "(comma-separated for several)")
        if self.rollout_rs and self.rollout_rs_threshold is None:
            raise ValueError("rollout_rs needs rollout_rs_threshold: a float (upper bound) or 'lower_upper', "
                             "one per option, comma-separated")
        return self


class WandbTracking(_Strict):
    """Weights & Biases; unset fields: the trainer's TRACKING_WANDB_* defaults, then wandb's own (WANDB_*)."""

    project: str | None = Field(None, min_length=1)
    entity: str | None = Field(None, min_length=1, description="team or user; default your W&B login's")
    mode: Literal["online", "offline"] | None = Field(
        None, description="offline: run files only (under the trainer's DATA_DIR/wandb), `wandb sync` them later")


class MlflowTracking(_Strict):
    """MLflow; unset fields: the trainer's TRACKING_MLFLOW_* defaults, then MLflow's own (MLFLOW_TRACKING_URI)."""

    tracking_uri: str | None = Field(
        None, min_length=1, description="http(s)://server:5000, sqlite:///path/mlflow.db or a local folder")
    experiment: str | None = Field(None, min_length=1, description="experiment name, created if missing")


class TensorBoardTracking(_Strict):
    dir: str | None = Field(None, min_length=1, description="folder of event files, one subfolder per run (on the "
                            "trainer's machine); default TRACKING_TENSORBOARD_DIR, else DATA_DIR/tensorboard")


class TrackingConfig(_Strict):
    """Experiment trackers the trainer logs this run to (any combination): its config at start, each policy
    version's metrics with the version as the step, a summary at the end. A tracker that fails is a warning and a
    count (metric tracker_errors), never a failed run."""

    wandb: WandbTracking | None = None
    mlflow: MlflowTracking | None = None
    tensorboard: TensorBoardTracking | None = None


class RunConfig(_Strict):
    schema_version: Literal[1] = 1
    name: str = Field(..., min_length=1, max_length=200)
    kind: Literal["train", "eval"] = "train"
    model: str = Field(..., min_length=1, description="local HF model folder or hub id")
    tokenizer: str | None = Field(None, description="defaults to `model`")
    dataset: str = Field(..., min_length=1, description="registered dataset name")
    dataset_split: str = "train"
    dataset_version: int | None = Field(
        None, ge=1, description="dataset version the run reads; unset: the latest, pinned when the run is created"
    )
    max_tasks: int | None = Field(None, ge=1, description="use only the first N rows of the dataset")
    agent: ComponentSpec
    env: ComponentSpec
    workflow: ComponentSpec | None = Field(None, description="multi-agent episodes; replaces the agent loop")
    agent_program: ComponentSpec | None = Field(
        None, description="an agent program by import path (`my_pkg.agent:run`, `async def run(task, client)` "
        "returning a reward or {reward, info}): run per (task, sample) in its own process against the rollout "
        "worker's OpenAI-compatible gateway; replaces the agent loop (agent and env are then unused)")
    engine: EngineConfig = Field(default_factory=EngineConfig)
    sampling: SamplingConfig = Field(default_factory=SamplingConfig)
    algorithm: AlgorithmConfig = Field(default_factory=AlgorithmConfig)
    samples_per_task: int = Field(1, ge=1, le=1024, description="n rollouts per task (group size)")
    tasks_per_batch: int = Field(8, ge=1, description="tasks per optimizer batch (train)")
    max_prompt_tokens: int = Field(1024, ge=1, description="prompt budget per model call, tokens")
    max_response_tokens: int = Field(512, ge=1, description="generation budget per model call, tokens")
    max_trajectory_tokens: int | None = Field(None, ge=1, description="prompt + all turns, tokens")
    max_context_tokens: int | None = Field(
        None, ge=1, description="the model's context window for one call (prompt + that call's response), tokens: "
        "a turn's response is cut to fit it, and a turn whose prompt leaves no room ends the episode as "
        "context_exceeded; default engine.max_model_len (vllm), else no limit")
    max_steps: int = Field(1, ge=1, description="agent turns per trajectory")
    trajectory_timeout_s: float = Field(600.0, gt=0)
    env_step_timeout_s: float = Field(30.0, gt=0)
    max_staleness: int = Field(0, ge=0, description="policy versions rollouts may run ahead; 0 = on-policy")
    stale_policy: Literal["drop", "downweight"] = "drop"
    partial_rollout: bool = Field(
        False, description="a generation in flight when a new policy version arrives continues on the new weights "
        "(hf engine: between decode chunks of engine.partial_chunk_tokens), each token tagged with the version that "
        "produced it; the trainer weighs each token by its own behaviour logprob and applies max_staleness to a "
        "sample's oldest token. Other engines finish a generation on the version it started on")
    max_in_flight: int = Field(256, ge=1, description="rollout tasks dispatched and not yet finished")
    max_attempts: int = Field(3, ge=1, description="attempts per (task, sample) on infrastructure failure")
    priority: float = Field(1.0, gt=0, le=1000, description="weight of this run's share of rollout capacity "
                            "against the other running runs (where the controller caps it: ROLLOUT_CAPACITY)")
    fail_fast_after: int | None = Field(
        None, ge=1, description="fail the run, with the reason in its error, once this many attempts in a row (none "
        "completed in between) failed for the same reason; default max(20, 2 * max_in_flight), so the sessions one "
        "dead worker held do not fail a run, and at most the run's first dispatch window (eval: every unit), so a "
        "small run whose first attempts all fail the same way fails after those")
    fail_fast_after_errors: int = Field(
        10, ge=1, description="fail the run, with the reason in its error, once this many units in a row (none "
        "scored in between) ended in a user-code error (env, reward function, agent, workflow or agent program "
        "raised, returned the wrong type or hung) for the same reason; at most the run's first dispatch window")
    epochs: int = Field(1, ge=1)
    total_steps: int | None = Field(None, ge=1, description="stop after this many optimizer steps")
    seed: int = 0
    tracking: TrackingConfig = Field(
        default_factory=TrackingConfig, description="W&B, MLflow, TensorBoard (train runs; the trainer also "
        "logs to those its TRACKING_* settings name for every run)")

    @field_validator("agent", "env", "workflow", "agent_program")
    @classmethod
    def _component(cls, v: ComponentSpec | None, info) -> ComponentSpec | None:
        if v is None:
            return v
        import_path_for(info.field_name, v.name)
        if v.name not in REGISTRIES[info.field_name]:  # a user import path must resolve now, not in a worker
            resolve(info.field_name, v.name)
        return v

    @model_validator(mode="before")
    @classmethod
    def _program_needs_no_agent(cls, data: Any) -> Any:
        # An agent program replaces the agent loop; agent/env stay required fields of every other run, so an
        # agent-program config may leave them out (placeholders, never used).
        if isinstance(data, dict) and data.get("agent_program"):
            data = {"agent": {"name": "math"}, "env": {"name": "math"}, **data}
        return data

    @model_validator(mode="after")
    def _sandbox(self) -> RunConfig:
        """`env.args.sandbox` (namespaces | container | none) is checked here, and written out for the built-in envs
        that run model-written code, so the stored config says the mode and no dataset row can override it (env
        args win over row fields). `none` is taken only when asked for by name; the run's status then warns."""
        if "sandbox" in self.env.args:
            if self.env.args["sandbox"] not in SANDBOX_MODES:
                raise ValueError(f"env.args.sandbox: unknown sandbox mode {self.env.args['sandbox']!r}; choose one of "
                                 f"{', '.join(SANDBOX_MODES)}")
            if self.env.args["sandbox"] == "container" and not self.env.args.get("image"):
                raise ValueError("env.args.image: sandbox 'container' runs each session in a container of this image "
                                 "(e.g. localhost/flywheel-sandbox-python:local, built by `make sandbox-image`)")
        elif self.env.name in MODEL_CODE_ENVS:
            self.env.args["sandbox"] = DEFAULT_SANDBOX_MODE
        return self

    @property
    def sandbox(self) -> str | None:
        """The mode model-written code of this run's env runs under (None: the env runs none of it, or says)."""
        return self.env.args.get("sandbox")

    @model_validator(mode="after")
    def _cross(self) -> RunConfig:
        est = self.algorithm.adv_estimator
        if self.kind == "train" and est in GROUP_ESTIMATORS and self.samples_per_task < 2:
            raise ValueError(
                f"samples_per_task: {est} compares samples of the same task, so it needs samples_per_task >= 2 "
                f"(got {self.samples_per_task})"
            )
        if self.algorithm.lora is not None and self.engine.type == "vllm" and (
                self.algorithm.lora.rank > self.engine.max_lora_rank):
            raise ValueError(f"engine.max_lora_rank ({self.engine.max_lora_rank}) is below algorithm.lora.rank "
                             f"({self.algorithm.lora.rank}): vLLM serves adapters up to max_lora_rank; raise it")
        if self.engine.type == "openai" and not self.engine.base_url:
            raise ValueError("engine.base_url: the openai engine needs the server URL, e.g. http://host:8000/v1")
        if self.max_in_flight < self.samples_per_task:
            raise ValueError(
                f"max_in_flight ({self.max_in_flight}) must be >= samples_per_task ({self.samples_per_task}) "
                "or a task's group can never be in flight at once"
            )
        if self.max_trajectory_tokens is not None and self.max_trajectory_tokens < self.max_prompt_tokens:
            raise ValueError("max_trajectory_tokens must be >= max_prompt_tokens")
        if self.max_context_tokens is not None:
            # a first call must fit whole, or a first answer could be cut short of max_response_tokens
            if self.max_context_tokens < self.max_prompt_tokens + self.max_response_tokens:
                raise ValueError(
                    f"max_context_tokens ({self.max_context_tokens}) must be >= max_prompt_tokens + "
                    f"max_response_tokens ({self.max_prompt_tokens} + {self.max_response_tokens}): a first model "
                    "call must fit the context; lower those budgets or raise max_context_tokens")
            if self.engine.type == "vllm" and self.engine.max_model_len is not None and (
                    self.max_context_tokens > self.engine.max_model_len):
                raise ValueError(f"max_context_tokens ({self.max_context_tokens}) is above engine.max_model_len "
                                 f"({self.engine.max_model_len}): vLLM refuses longer calls; lower it or leave it "
                                 "unset (it then defaults to max_model_len)")
        return self

    def context_room(self, prompt_tokens: int) -> int | None:
        """Tokens a model call with this prompt may generate within the context window (<= 0: none fit);
        None without a limit."""
        limit = self.max_context_tokens
        if limit is None and self.engine.type == "vllm":
            limit = self.engine.max_model_len
        return None if limit is None else limit - prompt_tokens

    @property
    def tokenizer_path(self) -> str:
        return self.tokenizer or self.model
