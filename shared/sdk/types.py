"""rLLM-compatible rollout data types, plus the token bookkeeping training needs.

Field names follow rLLM (`Step`, `Action`, `Trajectory`, `Episode`) so user agents written for rLLM run
unchanged. Added: per-step token ids, logprobs and the policy version that generated them (`weight_version`),
and per-trajectory assembled token arrays (`TokenSequence`) with a loss mask.
"""

from __future__ import annotations

import copy
import enum
import uuid
from dataclasses import dataclass, field
from typing import Any


class TerminationReason(enum.StrEnum):
    """Why a trajectory ended. `INFRA_ERROR` and `CANCELLED` are never scored: infrastructure failures are
    retried as a new attempt and masked out of the loss (a lost env session is not the policy's fault).
    `CONTEXT_EXCEEDED`: the next model call's prompt left no room in `max_context_tokens`; stored and scored,
    and masked out of the loss by default (`algorithm.mask_termination`)."""

    ENV_DONE = "env_done"
    MAX_STEPS = "max_steps"
    PROMPT_TRUNCATION = "prompt_truncation"
    RESPONSE_TRUNCATION = "response_truncation"
    CONTEXT_EXCEEDED = "context_exceeded"
    ENV_TIMEOUT = "env_timeout"
    TIMEOUT = "timeout"
    ERROR = "error"
    INFRA_ERROR = "infra_error"
    CANCELLED = "cancelled"
    UNKNOWN = "unknown"

    @property
    def trainable(self) -> bool:
        return self not in (TerminationReason.INFRA_ERROR, TerminationReason.CANCELLED)


@dataclass
class Action:
    action: Any = None


@dataclass
class Step:
    """One model call and the environment's answer to it."""

    prompt_ids: list[int] = field(default_factory=list)
    response_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    chat_completions: list[dict[str, Any]] = field(default_factory=list)
    observation: Any = None
    thought: str = ""
    action: Any = None
    model_response: str = ""
    info: dict = field(default_factory=dict)
    reward: float = 0.0
    done: bool = False
    mc_return: float = 0.0
    advantage: list[float] | float | None = None
    # Policy version of the weights that produced response_ids (None before generation); with partial rollouts
    # the version the generation started on, and response_versions the version of each token (else empty).
    weight_version: int | None = None
    response_versions: list[int] = field(default_factory=list)
    # Milliseconds spent generating this step's response and in the environment's step (the rollout worker).
    gen_ms: float = 0.0
    env_ms: float = 0.0

    def __post_init__(self):
        self.chat_completions = copy.deepcopy(self.chat_completions)
        self.info = copy.deepcopy(self.info)
        if self.logprobs and len(self.logprobs) != len(self.response_ids):
            raise ValueError(
                f"Step.logprobs has {len(self.logprobs)} entries but response_ids has {len(self.response_ids)}; "
                "they must align token for token"
            )


@dataclass
class TokenSequence:
    """A trajectory's multi-turn token stream as the trainer consumes it.

    `prompt_ids` is the first prompt; `response_ids` is everything after it: model tokens (mask 1) interleaved
    with observation/chat-template tokens (mask 0). `logprobs` and `versions` align with `response_ids`
    (0.0 / -1 where the mask is 0). `mismatch` is set when a later turn's prompt did not extend the
    accumulated context; the assembler then zeroes the mask, as rLLM does.
    """

    prompt_ids: list[int] = field(default_factory=list)
    response_ids: list[int] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    mismatch: bool = False


@dataclass
class Trajectory:
    uid: str = field(default_factory=lambda: str(uuid.uuid4()))
    name: str = "agent"
    task: Any = None
    steps: list[Step] = field(default_factory=list)
    reward: float | None = None
    info: dict = field(default_factory=dict)
    termination_reason: TerminationReason | None = None
    tokens: TokenSequence | None = None

    def is_cumulative(self) -> bool:
        """True when every step's chat history extends the previous step's (the multi-turn prefix property)."""
        prev: list | None = None
        for step in self.steps:
            cur = step.chat_completions
            if prev is not None and cur[: len(prev)] != prev:
                return False
            prev = cur
        return True

    @property
    def policy_versions(self) -> tuple[int | None, int | None]:
        versions = [v for s in self.steps for v in (s.response_versions or [s.weight_version]) if v is not None]
        return (min(versions), max(versions)) if versions else (None, None)


@dataclass
class Episode:
    """One rollout of one task (rLLM's workflow output): one or more trajectories, e.g. solver and judge."""

    id: str = ""  # "<task_id>:<sample_idx>"
    task: Any = None
    termination_reason: TerminationReason | None = None
    is_correct: bool = False
    trajectories: list[Trajectory] = field(default_factory=list)
    metrics: dict = field(default_factory=dict)
    info: dict = field(default_factory=dict)

    @property
    def task_id(self) -> str:
        return self.id.rsplit(":", 1)[0]


def compute_mc_returns(trajectory: Trajectory, gamma: float = 1.0) -> None:
    """Fill each step's Monte-Carlo return G_t = r_t + gamma * G_{t+1} (rLLM's `mc_return`)."""
    ret = 0.0
    for step in reversed(trajectory.steps):
        ret = step.reward + gamma * ret
        step.mc_return = ret
