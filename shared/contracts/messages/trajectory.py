"""Stream `trajectories`: rollout workers -> the trajectory store (group "store"), which passes what it accepts on
to the trainer (`results.accepted`, see shared/contracts/messages/training.py).

One `EpisodeResult` per (run, task, sample, attempt). `status="failed"` is an infrastructure failure (lost env
session, inference down after retries): recorded, re-dispatched by the controller as a new attempt, never
trained on. A user env raising is `completed` with termination reason `error` (stored, masked from the loss).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from shared.contracts.messages.codec import Logprobs, Message, TokenIds
from shared.sdk.types import Step, TerminationReason, TokenSequence, Trajectory


class TrajectoryStep(BaseModel):
    """One step (one model call and what the env answered) of a trajectory on the wire."""

    model_config = ConfigDict(extra="ignore")

    prompt_ids: TokenIds = Field(default_factory=list)
    response_ids: TokenIds = Field(default_factory=list)
    logprobs: Logprobs = Field(default_factory=list)
    chat_completions: list[dict[str, Any]] = Field(default_factory=list)
    observation: Any = None
    thought: str = ""
    action: Any = None
    model_response: str = ""
    info: dict[str, Any] = Field(default_factory=dict)
    reward: float = 0.0
    done: bool = False
    mc_return: float = 0.0
    weight_version: int | None = None
    response_versions: TokenIds = Field(
        default_factory=list, description="the policy version of each response token when a partial rollout "
        "changed versions mid-generation; empty: all weight_version")
    gen_ms: float = 0.0
    env_ms: float = 0.0
    # Compact form (TrajectoryRecord.compact): None means the field above holds the step whole.
    chat_from: int | None = Field(
        None, description="chat_completions holds only the messages this step added to the step before's; the "
        "chat began at this step (its index in the trajectory's steps), which holds it whole")
    stream_slice: tuple[int, int] | None = Field(
        None, description="(prompt length, response length): prompt_ids, response_ids and logprobs are left out; "
        "they are the trajectory's stream (prompt_ids + response_ids) sliced there, logprobs at the same positions")

    @property
    def lengths(self) -> tuple[int, int]:
        """(prompt tokens, response tokens), whether the arrays are carried or left to the stream."""
        return self.stream_slice or (len(self.prompt_ids), len(self.response_ids))

    @classmethod
    def from_step(cls, step: Step, **timing: float) -> TrajectoryStep:
        action = step.action.action if hasattr(step.action, "action") else step.action
        return cls(
            prompt_ids=step.prompt_ids, response_ids=step.response_ids, logprobs=step.logprobs,
            chat_completions=step.chat_completions, observation=step.observation, thought=step.thought,
            action=action, model_response=step.model_response, info=step.info, reward=step.reward,
            done=step.done, mc_return=step.mc_return, weight_version=step.weight_version,
            response_versions=step.response_versions,
            **({"gen_ms": step.gen_ms, "env_ms": step.env_ms} | timing),
        )


class TrajectoryRecord(BaseModel):
    model_config = ConfigDict(extra="ignore")

    uid: str
    name: str = "agent"
    reward: float = 0.0
    termination_reason: TerminationReason = TerminationReason.UNKNOWN
    info: dict[str, Any] = Field(default_factory=dict)
    steps: list[TrajectoryStep] = Field(default_factory=list)
    # Assembled multi-turn token stream (see shared.sdk.types.TokenSequence).
    prompt_ids: TokenIds = Field(default_factory=list)
    response_ids: TokenIds = Field(default_factory=list)
    loss_mask: TokenIds = Field(default_factory=list)
    logprobs: Logprobs = Field(default_factory=list)
    versions: TokenIds = Field(default_factory=list)
    mismatch: bool = False

    @classmethod
    def from_trajectory(cls, traj: Trajectory) -> TrajectoryRecord:
        tokens = traj.tokens or TokenSequence()
        return cls(
            uid=traj.uid, name=traj.name,
            reward=float(traj.reward if traj.reward is not None else sum(s.reward for s in traj.steps)),
            termination_reason=traj.termination_reason or TerminationReason.UNKNOWN, info=traj.info,
            steps=[TrajectoryStep.from_step(s) for s in traj.steps],
            prompt_ids=tokens.prompt_ids, response_ids=tokens.response_ids, loss_mask=tokens.loss_mask,
            logprobs=tokens.logprobs, versions=tokens.versions, mismatch=tokens.mismatch,
        )

    @property
    def policy_versions(self) -> tuple[int | None, int | None]:
        v = [v for s in self.steps for v in (s.response_versions or [s.weight_version]) if v is not None]
        return (min(v), max(v)) if v else (None, None)

    def stream_slice(self, s: TrajectoryStep, stream: list[int]) -> tuple[int, int] | None:
        """(prompt length, response length) when step `s` is a slice of the stream (`stream`: prompt_ids +
        response_ids): its prompt the stream's first ids, its response the next, its logprobs the stream's at
        those positions; None otherwise (a retokenized or rewritten context)."""
        if s.stream_slice is not None:
            return s.stream_slice
        p, n = len(s.prompt_ids), len(s.response_ids)
        at = p - len(self.prompt_ids)
        ok = (at >= 0 and len(s.logprobs) == n and stream[:p] == s.prompt_ids and stream[p:p + n] == s.response_ids
              and self.logprobs[at:at + n] == s.logprobs)
        return (p, n) if ok else None

    def chat_deltas(self) -> list[tuple[int, list[dict[str, Any]]]]:
        """Per step: (the index of the step its chat began at, the messages it added to the step before's). A
        step whose chat does not extend the one before (the agent rewrote its history) begins anew, whole."""
        out, chat, start = [], [], 0
        for k, s in enumerate(self.steps):
            if s.chat_from is not None:  # compact already: as sent
                start, added = s.chat_from, s.chat_completions
                chat = (chat if start < k else []) + added
                out.append((start, added))
                continue
            whole = s.chat_completions
            if len(whole) >= len(chat) and whole[:len(chat)] == chat:
                added = whole[len(chat):]
            else:
                start, added = k, whole
            chat = whole
            out.append((start, added))
        return out

    def compact(self) -> TrajectoryRecord:
        """The same trajectory, linear in its length on the wire: a step after the first carries only the
        messages it added (`chat_from`) and, where its arrays are a slice of the stream, not the arrays
        (`stream_slice`). `expanded()` gives back the whole steps."""
        stream = self.prompt_ids + self.response_ids
        steps = [self.steps[0]] if self.steps else []
        for k, (s, (start, added)) in enumerate(zip(self.steps, self.chat_deltas(), strict=True)):
            if k == 0:
                continue
            update: dict[str, Any] = {"chat_from": start, "chat_completions": added}
            if (cut := self.stream_slice(s, stream)) is not None:
                update |= {"stream_slice": cut, "prompt_ids": [], "response_ids": [], "logprobs": []}
            steps.append(s.model_copy(update=update))
        return self.model_copy(update={"steps": steps})

    def expanded(self) -> TrajectoryRecord:
        """Every step whole (its whole chat and its arrays), from the compact form or the whole one."""
        stream, plen = self.prompt_ids + self.response_ids, len(self.prompt_ids)
        steps, chat = [], []
        for k, (s, (start, added)) in enumerate(zip(self.steps, self.chat_deltas(), strict=True)):
            chat = (chat if start < k else []) + added
            update: dict[str, Any] = {"chat_from": None, "chat_completions": chat}
            if s.stream_slice is not None:
                p, n = s.stream_slice
                update |= {"stream_slice": None, "prompt_ids": stream[:p], "response_ids": stream[p:p + n],
                           "logprobs": self.logprobs[p - plen:p - plen + n]}
            steps.append(s.model_copy(update=update))
        return self.model_copy(update={"steps": steps})


class EpisodeResult(Message):
    TYPE = "episode_result"
    # 2: steps may be compact (TrajectoryRecord.compact), which a version-1 reader would store as whole steps;
    # a version-1 message is all whole steps, read as it always was.
    SCHEMA_VERSION = 2
    MIN_SCHEMA_VERSION = 1

    run_id: str
    task_id: str
    sample_idx: int = Field(ge=0)
    attempt: int = Field(0, ge=0)
    # completed: a scored result; error: the user's code (env, reward fn, agent, workflow, agent program) raised,
    # returned the wrong type or hung, `error` says where and why (never trained on, never scored, not retried);
    # failed: infrastructure failed (re-dispatched while attempts remain).
    status: Literal["completed", "error", "failed"]
    termination_reason: TerminationReason
    is_correct: bool = False
    reward: float = 0.0
    task: dict[str, Any] = Field(default_factory=dict)
    trajectories: list[TrajectoryRecord] = Field(default_factory=list)
    metrics: dict[str, Any] = Field(default_factory=dict)
    info: dict[str, Any] = Field(default_factory=dict)
    error: str | None = None
    worker_id: str = ""
    batch_idx: int = 0
    greedy: bool = False
    started_at: float = 0.0
    finished_at: float = 0.0
    traceparent: str | None = Field(
        None, description="W3C traceparent of the unit's rollout span (docs/observability.md); None: tracing "
        "off, or a writer that predates the field")

    @property
    def key(self) -> tuple[str, str, int, int]:
        return (self.run_id, self.task_id, self.sample_idx, self.attempt)

    def wire_version(self) -> int:
        compact = any(s.chat_from is not None or s.stream_slice is not None
                      for t in self.trajectories for s in t.steps)
        return 2 if compact else 1

    def expanded(self) -> EpisodeResult:
        """The result with every step whole (rollout workers send trajectories compact)."""
        return self.model_copy(update={"trajectories": [t.expanded() for t in self.trajectories]})

    @property
    def policy_versions(self) -> tuple[int | None, int | None]:
        lo = [t.policy_versions[0] for t in self.trajectories if t.policy_versions[0] is not None]
        hi = [t.policy_versions[1] for t in self.trajectories if t.policy_versions[1] is not None]
        return (min(lo) if lo else None, max(hi) if hi else None)
