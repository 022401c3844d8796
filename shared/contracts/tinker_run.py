"""The config of a Tinker training run: one LoRA training client of the Tinker API (docs/tinker.md), stored in
`runs.config` of a run of kind `tinker`. The API sends it in a `create` run command; the controller stores the run
`running` and never drives it (its work arrives as Tinker operations, not rollout tasks). A sampling session of
a base model is a run of this kind too (`lora` None): its samples are stored as its episodes."""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from shared.contracts.run_config import AlgorithmConfig, EngineConfig, LoRAConfig

FUTURE_TTL_S = 24 * 3600  # a future's record is kept this long after it is made or answered
MODEL_TTL_S = 7 * 24 * 3600  # a model's records (and a session's, from its last heartbeat) are kept this long
# The losses served, and the loss inputs each needs besides `target_tokens` (one value per input token)
LOSS_INPUTS: dict[str, tuple[str, ...]] = {
    "cross_entropy": (),  # `weights` optional: every token weighs 1 without
    "importance_sampling": ("logprobs", "advantages"),
    "ppo": ("logprobs", "advantages"),
    "gspo": ("logprobs", "advantages"),
    "cispo": ("logprobs", "advantages"),
    "dro": ("logprobs", "advantages"),
    "stable_reinforce": ("logprobs", "advantages"),
}
# Losses trained against the samples their datums' provenance names (the API fills in the recorded logprobs)
SAMPLED_LOSSES = ("stable_reinforce",)
# The inputs a loss takes when given: gspo's sequence ratio covers the tokens `sequence_ratio_mask` marks, by default
# those with a nonzero advantage (the tinker-cookbook's RL datums send no mask and give prompt tokens advantage 0)
LOSS_OPTIONAL_INPUTS: dict[str, tuple[str, ...]] = {"gspo": ("sequence_ratio_mask",)}
# Each loss's loss_fn_config: its keys and their defaults (None: the client must give it)
LOSS_CONFIG: dict[str, dict[str, float | None]] = {
    "ppo": {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2},
    "gspo": {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2},  # ppo's; the GSPO paper's are 1 - 3e-4, 1 + 4e-4
    "cispo": {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2},
    "dro": {"beta": None},
    # the importance weight's cap (verl's rollout-correction default) and the KL-to-sampler penalty's weight
    "stable_reinforce": {"truncation": 2.0, "kl_coeff": 0.0},
}
CHECKPOINT_NAME = re.compile(r"[A-Za-z0-9._-]{1,128}")
CHECKPOINT_KINDS = ("weights", "sampler_weights", "external_weights")  # tinker://<model id>/<kind>/<name>
COMPLETIONS_MAXLEN = 100_000  # a completion queue's bound (its poller trims what it has seen; this, what it never polls)
CLIENT_SEQ_BLOCK = 1_000_000_000  # a sampling client's seq_ids are client number * this + n (the SDK's numbering)
MAX_AGE_RECIPIENTS = 10  # save_weights_external: the most age recipients an export is encrypted to (the SDK's)
LORA_ALPHA = 32  # Tinker's LoRA scaling numerator (its clients choose the rank only)


class TinkerRunConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", protected_namespaces=())

    kind: Literal["tinker"] = "tinker"
    name: str = Field(..., max_length=200)
    model_id: str = Field(..., description="the Tinker model id: <session id>:train:<model_seq_id>")
    session_id: str
    owner: str = Field(..., description="sha256 of the flywheel token whose tml- key made it")
    owner_name: str = Field(..., description="that token's name (API_TOKEN for the bootstrap token)")
    base_model: str = Field(..., description="the name the client gave, as get_server_capabilities offers it")
    model: str = Field(..., description="the folder or hub id of the base model")
    lora: dict[str, Any] | None = Field(..., description="the client's LoRA config: rank, seed, train_mlp/attn/unembed; "
                                        "None: a sampling session of the base model (never trained)")
    engine: EngineConfig = Field(default_factory=EngineConfig, description="the rollout workers' engine for its samples")
    optimizer: dict[str, Any] = Field(default_factory=lambda: {"type": "adamw"})
    user_metadata: dict[str, Any] = Field(default_factory=dict)

    def algorithm(self) -> AlgorithmConfig:
        """The trainer engine's config for this model: its LoRA on the modules the client asked to train. The
        optimizer's hyperparameters come with each optim_step; the engine's lr and clip are placeholders."""
        lora = self.lora
        targets = ([*(("q_proj", "k_proj", "v_proj", "o_proj") if lora.get("train_attn", True) else ()),
                    *(("gate_proj", "up_proj", "down_proj") if lora.get("train_mlp", True) else ())]
                   or "all-linear")
        return AlgorithmConfig(lora=LoRAConfig(rank=lora["rank"], alpha=LORA_ALPHA, target_modules=targets),
                               lr=1e-4, grad_clip=1e9)


def checkpoint_name_ok(name: str) -> bool:
    """A checkpoint's name: 1-128 letters, digits, '.', '_' or '-', not starting with '.' (it names a folder of
    the trainer's and of the weight server's: '..' would be another one)."""
    return CHECKPOINT_NAME.fullmatch(name) is not None and not name.startswith(".")


def completion_queue(sampling_session_id: str, seq_id: int) -> str:
    """The Redis stream where the answers of one sampling client's requests are announced (retrieve_futures)."""
    return f"tinker:completions:{sampling_session_id}:{seq_id // CLIENT_SEQ_BLOCK}"


def training_model_id(session_id: str, model_seq_id: int) -> str:
    """The id the SDK itself derives for a session's training model."""
    return f"{session_id}:train:{model_seq_id}"


def session_of_model(model_id: str) -> str:
    """The session a training model id belongs to (the inverse of training_model_id's first part)."""
    return model_id.split(":train:", 1)[0]


def checkpoint_path(model_id: str, kind: str, name: str) -> str:
    return f"tinker://{model_id}/{kind}/{name}"


def parse_checkpoint_path(path: str) -> tuple[str, str, str] | None:
    """(model id, kind, name) of a tinker:// checkpoint path, None if it is not one."""
    parts = path.removeprefix("tinker://").split("/")
    if not path.startswith("tinker://") or len(parts) != 3 or parts[1] not in CHECKPOINT_KINDS or not all(parts):
        return None
    return parts[0], parts[1], parts[2]


def sequence_id(request_id: str, index: int) -> str:
    """A sampled sequence's id (the SDK's `sequence_id`): the stored episode with task id `request_id` and sample
    index `index`."""
    return f"{request_id}:{index}"


def parse_sequence_id(sid: str) -> tuple[str, int] | None:
    """(request id, sample index) of a sequence id, None if it is not one."""
    request_id, _, index = sid.rpartition(":")
    return (request_id, int(index)) if request_id and index.isdigit() else None
