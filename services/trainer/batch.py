"""From stream messages to the tensors verl trains on. Pure: no Redis, Postgres or verl here.

A *sample* is one trajectory of one accepted episode; a *group* is every sample of one task in one batch
(`samples_per_task` of them, plus ReMax's greedy baseline sample when the estimator needs it). Training
batches are made of whole groups, so group-relative estimators (GRPO, RLOO, ...) always see full groups.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Collection
from dataclasses import dataclass, field

import numpy as np
import torch
from prometheus_client import Counter

from shared.contracts.messages import EpisodeResult, TrajectoryRecord
from shared.contracts.run_config import MASKED_TERMINATIONS
from shared.sdk.types import TerminationReason

SampleKey = tuple[str, str, int]  # (run_id, task_id, sample_idx): the acceptance rule's identity
GroupKey = tuple[str, int]  # (task_id, batch_idx): every episode of one task in one batch
WITHOUT_LOGPROBS = Counter("trainer_samples_without_logprobs_total", "Samples masked out of the loss because "
                           "they carry no behaviour logprob for some trained token (never replaced by a guess)")


@dataclass
class Sample:
    key: SampleKey
    attempt: int
    group: GroupKey
    prompt_ids: list[int]
    response_ids: list[int]
    loss_mask: list[int]
    logprobs: list[float]
    reward: float
    min_version: int
    greedy: bool = False
    weight: float = 1.0  # stale samples may be down-weighted
    traj_idx: int = 0  # position in its episode: a workflow may produce several trajectories of one name
    name: str = "agent"  # the trajectory's role (solver, judge, ...)
    versions: list[int] = field(default_factory=list)  # policy version that generated each token (-1: env's)
    masked: str | None = None  # the termination reason (algorithm.mask_termination) that zeroed its loss mask
    # an earlier sequence of a trajectory the agent cut by rewriting its history: the traj_idx of its last
    # sequence, whose advantage it takes (it joins no group statistics of its own)
    advantage_from: int | None = None

    @property
    def uid(self) -> str:
        """verl's group index: the trajectories of one role across the task's episodes are compared."""
        return f"{self.group[0]}/{self.group[1]}/{self.name}"


def excluded_reason(result: EpisodeResult) -> str | None:
    """Why a result is never trained on (it is still recorded as consumed), or None if it is trainable."""
    if result.status != "completed":
        return "failed"
    if not TerminationReason(result.termination_reason).trainable:
        return str(TerminationReason(result.termination_reason).value)
    if not any(t.response_ids for t in result.trajectories):
        return "empty"
    return None


def samples_from_result(result: EpisodeResult,
                        mask_termination: Collection[str] = MASKED_TERMINATIONS) -> list[Sample]:
    """One sample per trajectory. A user-env ERROR, and a trajectory that ended for a reason named in
    `mask_termination` (the run's algorithm.mask_termination; its own reason, else the episode's), keep their
    reward in the group but contribute no loss.

    A trajectory without a real behaviour logprob for every trained token (none sent, misaligned, or not
    finite) keeps its reward in the group but contributes no loss, and is counted in
    `trainer_samples_without_logprobs_total`: a made-up value would bias the importance-sampling weights."""
    masked = result.termination_reason == TerminationReason.ERROR
    out = []
    for traj_idx, traj in enumerate(result.trajectories):
        if not traj.response_ids:
            continue
        reason = traj.termination_reason if traj.termination_reason != TerminationReason.UNKNOWN \
            else result.termination_reason
        by_reason = reason.value if reason.value in mask_termination else None
        mask = [0] * len(traj.response_ids) if masked or by_reason or traj.mismatch else list(traj.loss_mask)
        logprobs = list(traj.logprobs)
        if not _has_behaviour_logprobs(logprobs, mask):
            WITHOUT_LOGPROBS.inc()
            mask = [0] * len(traj.response_ids)
            logprobs = [0.0] * len(traj.response_ids)  # never read: zero mask, and build_tensors multiplies by it
        out.append(Sample(
            key=(result.run_id, result.task_id, result.sample_idx), attempt=result.attempt,
            group=(result.task_id, result.batch_idx), prompt_ids=list(traj.prompt_ids),
            response_ids=list(traj.response_ids), loss_mask=mask, logprobs=logprobs, reward=float(traj.reward),
            min_version=_min_version(traj.versions, mask, traj.policy_versions[0]), greedy=result.greedy,
            traj_idx=traj_idx, name=traj.name,
            versions=list(traj.versions) if len(traj.versions) == len(traj.response_ids) else [],
            masked=by_reason, advantage_from=_last_sequence(traj, traj_idx),
        ))
    return out


def _last_sequence(traj: TrajectoryRecord, traj_idx: int) -> int | None:
    """The traj_idx of the last sequence of a trajectory cut at its context rewrites (the rollout worker sends
    the n sequences in order, each with info `sequence` k of `sequences` n); None for the last or an uncut one."""
    k, n = traj.info.get("sequence"), traj.info.get("sequences")
    if not isinstance(k, int) or not isinstance(n, int) or k >= n - 1:
        return None
    return traj_idx + (n - 1 - k)


def _has_behaviour_logprobs(logprobs: list[float], mask: list[int]) -> bool:
    if len(logprobs) != len(mask):
        return False
    return all(math.isfinite(lp) for lp, m in zip(logprobs, mask, strict=True) if m)


def _min_version(versions: list[int], mask: list[int], fallback: int | None) -> int:
    trained = [v for v, m in zip(versions, mask, strict=False) if m and v >= 0]
    if trained:
        return min(trained)
    known = [v for v in versions if v >= 0]
    return min(known) if known else (fallback or 0)


@dataclass
class Group:
    key: GroupKey
    # (sample_idx, traj_idx) -> sample: every trajectory of the task's n episodes. Groups are chosen, dropped
    # and recorded whole (per episode); advantages compare trajectories of one role (`Sample.uid`), so a
    # solver-judge episode's two "solver" trajectories join the other episodes' solvers.
    samples: dict[tuple[int, int], Sample] = field(default_factory=dict)
    greedy: dict[str, Sample] = field(default_factory=dict)  # ReMax's greedy baseline trajectory per role

    @property
    def rewards(self) -> list[float]:
        return [s.reward for s in self.samples.values()]

    def complete(self, n: int, need_greedy: bool) -> bool:
        episodes = {k[0] for k in self.samples}  # an episode's trajectories arrive together
        return len(episodes) >= n and (bool(self.greedy) or not need_greedy)

    def all_samples(self) -> list[Sample]:
        return list(self.samples.values()) + list(self.greedy.values())


class GroupBuffer:
    """Collects samples into groups; hands out complete groups in arrival order."""

    def __init__(self, samples_per_task: int, need_greedy: bool):
        self.n, self.need_greedy = samples_per_task, need_greedy
        self.groups: dict[GroupKey, Group] = {}

    def add(self, sample: Sample) -> None:
        group = self.groups.setdefault(sample.group, Group(sample.group))
        if sample.greedy:
            group.greedy.setdefault(sample.name, sample)
        else:
            group.samples.setdefault((sample.key[2], sample.traj_idx), sample)

    def complete_groups(self) -> list[Group]:
        return [g for g in self.groups.values() if g.complete(self.n, self.need_greedy)]

    def incomplete_groups(self) -> list[Group]:
        return [g for g in self.groups.values() if not g.complete(self.n, self.need_greedy)]

    def remove(self, groups: list[Group]) -> None:
        for g in groups:
            self.groups.pop(g.key, None)


def mismatch_probe(buffer: GroupBuffer, version: int, limit: int = 64) -> list[Sample]:
    """Up to `limit` waiting samples with trained tokens that `version` generated. The trainer, still at
    `version` before its step, measures the training-inference mismatch on them as well: with max_staleness >= 1
    the batch it trains on is mostly older samples, whose difference is the policy's change, not the engines'."""
    out: list[Sample] = []
    for group in buffer.groups.values():
        for s in group.samples.values():
            if any(v == version and m for v, m in zip(s.versions, s.loss_mask, strict=False)):
                out.append(s)
                if len(out) == limit:
                    return out
    return out


def select_groups(
    groups: list[Group], num_groups: int, *, dynamic_sampling: bool, version: int, max_staleness: int,
    stale_policy: str,
) -> tuple[list[Group], dict[str, list[Group]]]:
    """Pick up to `num_groups` groups for the next step, in order; return (chosen, dropped by reason).

    A group older than `max_staleness` versions (its oldest token's version) is dropped, or kept with each
    stale sample's weight scaled by 1 / (1 + versions beyond the bound) under `stale_policy="downweight"`.
    With `dynamic_sampling`, groups whose rewards are all equal (no learning signal) are dropped and later
    groups fill their places."""
    chosen: list[Group] = []
    dropped: dict[str, list[Group]] = defaultdict(list)
    for g in groups:
        if len(chosen) == num_groups:
            break
        excess = version - min(s.min_version for s in g.samples.values()) - max_staleness
        if excess > 0 and stale_policy == "drop":
            dropped["stale"].append(g)
            continue
        if dynamic_sampling and len(set(g.rewards)) <= 1:
            dropped["filtered"].append(g)
            continue
        for s in g.samples.values():
            s.weight = 1.0 / (1 + max(0, version - s.min_version - max_staleness))
        chosen.append(g)
    return chosen, dropped


def doomed_groups(waiting: list[Group], unfinishable: set[GroupKey]) -> list[Group]:
    """The waiting groups that can never complete (`unfinishable`: keys of groups with a slot out of attempts,
    greedy baselines included, or a stored result with nothing to train on)."""
    return [g for g in waiting if g.key in unfinishable]


def staleness(samples: list[Sample], version: int) -> list[int]:
    return [version - s.min_version for s in samples]


def build_tensors(groups: list[Group], pad_id: int) -> dict:
    """Left-padded prompts, right-padded responses, masks, outcome rewards on the last trained token,
    behaviour logprobs and the policy version of each response token (-1: not the model's, or unknown), the
    group index (`uid`) and ReMax's greedy baseline reward per row; `advantage_from`: for an earlier sequence of a
    cut trajectory the row of its last sequence (else -1), and a group index of its own."""
    rows = [s for g in groups for s in g.samples.values()]
    row_of = {(s.key, s.traj_idx): i for i, s in enumerate(rows)}
    advantage_from = [row_of.get((s.key, s.advantage_from), -1) if s.advantage_from is not None else -1
                      for s in rows]
    baselines = [g.greedy[s.name].reward if s.name in g.greedy else 0.0 for g in groups for s in g.samples.values()]
    P = max(len(s.prompt_ids) for s in rows)
    R = max(len(s.response_ids) for s in rows)
    B = len(rows)
    prompts = torch.full((B, P), pad_id, dtype=torch.long)
    responses = torch.full((B, R), pad_id, dtype=torch.long)
    attention = torch.zeros((B, P + R), dtype=torch.long)
    response_mask = torch.zeros((B, R), dtype=torch.long)
    behaviour = torch.zeros((B, R), dtype=torch.float32)
    versions = torch.full((B, R), -1, dtype=torch.long)
    rewards = torch.zeros((B, R), dtype=torch.float32)
    for i, s in enumerate(rows):
        p, r = len(s.prompt_ids), len(s.response_ids)
        prompts[i, P - p:] = torch.tensor(s.prompt_ids)
        responses[i, :r] = torch.tensor(s.response_ids)
        attention[i, P - p:P + r] = 1
        response_mask[i, :r] = torch.tensor(s.loss_mask[:r])
        behaviour[i, :r] = torch.tensor(s.logprobs[:r])
        if s.versions:
            versions[i, :r] = torch.tensor(s.versions[:r])
        rewards[i, _last_trained(s.loss_mask, r)] = s.reward
    return {
        "prompts": prompts, "responses": responses, "input_ids": torch.cat([prompts, responses], 1),
        "attention_mask": attention, "position_ids": (attention.cumsum(-1) - 1).clamp(min=0),
        "response_mask": response_mask, "behaviour_log_probs": behaviour * response_mask,
        "behaviour_versions": versions,
        "token_level_rewards": rewards, "reward_baselines": torch.tensor(baselines, dtype=torch.float32),
        "sample_weights": torch.tensor([s.weight for s in rows], dtype=torch.float32),
        "uid": np.array([s.uid if j < 0 else f"{s.uid}/{s.key[2]}/{s.traj_idx}" for s, j in zip(rows, advantage_from,
                                                                                      strict=True)], dtype=object),
        "advantage_from": torch.tensor(advantage_from, dtype=torch.long),
    }


def _last_trained(mask: list[int], length: int) -> int:
    for i in range(length - 1, -1, -1):
        if mask[i]:
            return i
    return length - 1
