"""The Tinker protocol's work (docs/tinker.md). The API checks and decodes the SDK's request, stores the
operation's future as `try_again`, then sends:

- `tinker.ops.<model id>` (API -> trainer): `TinkerOp`, one training operation of one LoRA model; the trainer that
  holds the model applies them in `seq_id` order. `tinker.requests` (API -> trainers): `TinkerWake`, that model
  has work; a trainer that can take the model's lease starts reading its stream.
- `tinker.samples` (API -> rollout workers): `TinkerSample`, one sample request of a sampling session; its
  samples are stored as trajectories of the session's run, its answer announced on the client's completions.

Whoever does the work writes the result into the future (`TinkerFuture`), where `retrieve_future` reads it."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, Field

from shared.contracts.messages.codec import Logprobs, Message, TokenIds

MAX_TOPK_LOGPROBS = 20  # vLLM's default max_logprobs: the most a rollout worker's engine returns
TinkerOpKind = Literal["forward_backward", "forward", "optim_step", "save_weights", "save_weights_for_sampler",
                       "save_weights_external", "load_weights"]


class TinkerDatum(BaseModel):
    """One datum: the model input's tokens and the loss inputs, each one value per input token."""

    tokens: TokenIds
    target_tokens: TokenIds
    weights: Logprobs | None = None  # cross_entropy (None: every token weighs 1); stable_reinforce: 1 where sampled
    advantages: Logprobs | None = None  # importance_sampling, ppo
    logprobs: Logprobs | None = None  # the sampler's logprobs of target_tokens: importance_sampling, ppo
    sequence_ratio_mask: Logprobs | None = None  # gspo: nonzero at the tokens its ratio covers (None: advantage != 0)


class AdamStep(BaseModel):
    """The SDK's AdamParams of one optim_step."""

    learning_rate: float = Field(1e-4, ge=0)
    beta1: float = Field(0.9, ge=0, lt=1)
    beta2: float = Field(0.95, ge=0, lt=1)
    eps: float = Field(1e-12, gt=0)
    weight_decay: float = Field(0.0, ge=0)
    grad_clip_norm: float = Field(0.0, ge=0, description="0: no clipping")


class TinkerOp(Message):
    TYPE = "tinker_op"
    # 2: save_weights_external, 3: gspo, 4: stable_reinforce (a reader of an older version refuses what it does not
    # know)
    SCHEMA_VERSION = 4
    MIN_SCHEMA_VERSION = 1

    request_id: str  # the future the result goes to
    owner: str  # sha256 of the key's token: the future's owner
    model_id: str
    run_id: str  # the model's run of kind `tinker` (its config: base model and LoRA)
    seq_id: int = Field(ge=0)
    op: TinkerOpKind
    loss_fn: str | None = None
    loss_fn_config: dict[str, float] = Field(default_factory=dict)
    data: list[TinkerDatum] = Field(default_factory=list)
    adam: AdamStep | None = None
    name: str | None = None  # save_weights*: the checkpoint's name (its tinker:// path ends with it)
    path: str | None = None  # load_weights: the tinker:// path of a `save_weights` checkpoint
    optimizer: bool = False  # load_weights: the Adam state too
    sampling_session_id: str | None = None  # save_weights_for_sampler: the session made for its weights
    ttl_s: float | None = Field(None, gt=0, description="save_weights*: the checkpoint expires this long after it "
                                "is saved (the SDK's ttl_seconds); None: kept until deleted")
    user_metadata: dict[str, str] = Field(default_factory=dict)  # save_weights*: kept with the checkpoint
    age_recipients: list[str] = Field(default_factory=list)  # save_weights_external: encrypt each file to these
    sent_at: float = 0.0

    def wire_version(self) -> int:
        if self.loss_fn == "stable_reinforce":
            return 4
        if self.loss_fn == "gspo" or any(d.sequence_ratio_mask is not None for d in self.data):
            return 3
        return 2 if self.op == "save_weights_external" else 1


class TinkerWake(Message):
    TYPE = "tinker_wake"
    SCHEMA_VERSION = 1

    model_id: str  # whose operations stream (`tinker.ops.<model id>`) has work
    run_id: str  # the model's run: its trainer lease says who holds the model


class TinkerSample(Message):
    TYPE = "tinker_sample"
    # 2: logprob requests (prompt, top-k) and seed; 3: target prompt logprobs and prompt alt tokens (a reader of an
    # older version would answer without what it does not know); 4: store_run_id (one would store the samples in
    # the publisher's run)
    SCHEMA_VERSION = 4
    MIN_SCHEMA_VERSION = 1

    request_id: str  # the future the result goes to
    owner: str
    run_id: str  # the run whose engine serves it: a training model's (its adapter) or a base sampling session's
    # the run its samples are stored in when not `run_id`: another key's sampler of published weights (the
    # publisher's run serves them; the samples are the sampling key's own)
    store_run_id: str | None = None
    version: int = Field(0, ge=0, description="the run's weight version to sample from (0: the base)")
    sequence_ids: list[str]  # one per sample: the SDK's sample_sequence_ids, the stored episodes' task ids
    prompt: TokenIds
    num_samples: int = Field(ge=1, le=1024)
    max_tokens: int = Field(ge=1)
    temperature: float = Field(1.0, ge=0)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = -1
    stop_strings: list[str] = Field(default_factory=list)
    stop_tokens: list[int] = Field(default_factory=list)
    prompt_logprobs: bool = False  # each prompt token's logprob under the model (the SDK's compute_logprobs)
    prompt_logprobs_last_n: int | None = Field(None, ge=1, description="only the last n prompt positions scored")
    topk_prompt_logprobs: int = Field(0, ge=0, le=MAX_TOPK_LOGPROBS)  # each prompt position's k likeliest tokens
    topk_sample_logprobs: int = Field(0, ge=0, le=MAX_TOPK_LOGPROBS)  # each sampled position's k likeliest tokens
    # per prompt position after the first, the token ids whose logprobs to return (-1: none); the rows of the SDK's
    # target_prompt_logprobs, sparse ones made dense: `target_sparse` says to answer in the request's CSR layout
    target_prompt_ids: list[list[int]] | None = None
    target_sparse: bool = False
    # k draws at the request's temperature from each prompt position's next-token distribution (after the first)
    prompt_alt_tokens_k: int = Field(0, ge=0, le=MAX_TOPK_LOGPROBS)
    seed: int | None = None  # sample i draws with seed + i: the same request with the same seed, the same samples
    # the completion queue (Redis stream `tinker:completions:<sampling session>:<client>`) where the answer is also
    # announced, for the client's retrieve_futures poller; None: only the future is written
    completions: str | None = None
    sent_at: float = 0.0
    # what its usage is counted under (shared/stores/tinker_usage.py): the sampling session's, its base model
    session_id: str | None = None
    base_model: str | None = None

    def wire_version(self) -> int:
        if self.store_run_id is not None:
            return 4
        if self.target_prompt_ids or self.prompt_alt_tokens_k:
            return 3
        asked = (self.prompt_logprobs, self.prompt_logprobs_last_n, self.topk_prompt_logprobs,
                 self.topk_sample_logprobs, self.seed is not None)
        return 2 if any(asked) else 1


class TinkerCheckpoint(BaseModel):
    """The record `tinker:checkpoint:<tinker path>`, written by the trainer once the checkpoint is durable:
    `weights` (adapter and Adam state, in the trainer's STATE_DIR), `sampler_weights` (the adapter, a version
    of the model's run on the weight server) or `external_weights` (the adapter in PEFT's layout, an export on
    the weight server that its owner downloads through signed URLs)."""

    owner: str
    model_id: str
    run_id: str
    kind: Literal["weights", "sampler_weights", "external_weights"]
    name: str
    base_model: str  # the name get_server_capabilities offers
    lora: dict[str, Any]
    seq_id: int  # the model's operations it holds
    folder: str | None = None  # weights: where the trainer saved it
    version: int | None = None  # sampler_weights: the run's version on the weight server
    files: dict[str, int] = Field(default_factory=dict)  # external_weights: file name -> bytes (".age": encrypted)
    size_bytes: int | None = None  # what it stores (None: recorded before sizes were kept)
    created_at: float
    user_metadata: dict[str, str] = Field(default_factory=dict)
    # deleted (then) or given a ttl: from then on it reads as absent, and the trainer removes its files and record
    expires_at: float | None = None

    def live(self, now: float) -> bool:
        return self.expires_at is None or self.expires_at > now


class TinkerFuture(BaseModel):
    """The record `tinker:future:<request id>`: its owner, its model, and the SDK's answer (try_again until
    the work is done, then the result or `{"error", "category"}`)."""

    owner: str
    model_id: str | None = None
    result: dict[str, Any]
    answered_at: float | None = None  # when the result was written (None: try_again): a session trace's ends
