"""The agent loop's token budgets against a fake engine and env (one character = one token): a turn's response is
cut so prompt + response never pass max_context_tokens, a turn whose prompt leaves no room ends the episode as
context_exceeded with the earlier steps kept, and the trainer gives that trajectory no loss by default. Also: a
partial rollout run asks the engine for it and its steps keep each token's version."""

from __future__ import annotations

import asyncio
import time

import pytest

from services.rollout_worker.builtin.agents import DigitsAgent
from services.rollout_worker.engines.base import Generation
from services.rollout_worker.episodes import run_episode
from services.rollout_worker.run_engines import RunContext
from services.trainer.batch import samples_from_result
from shared.contracts.messages import EnvReply, RolloutTask
from shared.contracts.run_config import RunConfig
from shared.sdk.types import TerminationReason as TR

REPLY = "x" * 1000  # longer than any budget below: every response is cut by one


class Chat:
    """A chat template that only appends ("role: content" lines), one token per character."""

    eos_ids: set[int] = set()

    def render(self, messages: list[dict], add_generation_prompt: bool) -> str:
        text = "".join(f"{m['role']}: {m['content']}\n" for m in messages)
        return text + ("assistant: " if add_generation_prompt else "")

    def encode(self, text: str) -> list[int]:
        return [ord(c) for c in text]

    def decode(self, ids: list[int]) -> str:
        return "".join(map(chr, ids))


class Engine:
    def __init__(self):
        self.calls: list[tuple[int, int]] = []  # (prompt tokens, max_tokens) per call

    async def generate(self, prompt_ids, sampling, max_tokens):
        self.calls.append((len(prompt_ids), max_tokens))
        ids = [ord(c) for c in REPLY[:max_tokens]]
        return Generation(ids=ids, logprobs=[-0.1] * len(ids), text=REPLY[:max_tokens],
                          finish_reason="length" if max_tokens < len(REPLY) else "stop", weight_version=0)


class Envs:
    """Says a number word every turn and never ends the episode."""

    async def call(self, op: str, session_id: str, **_) -> EnvReply:
        return EnvReply(request_id="r", session_id=session_id, env_worker_id="env-1", ok=True,
                        observation={"word": "seven" if op == "reset" else "one"})

    def close_quietly(self, *_, **__) -> None:
        pass


def episode(**budgets):
    cfg = RunConfig.model_validate({
        "name": "ctx", "kind": "eval", "model": "m", "dataset": "d", "agent": {"name": "digits"},
        "env": {"name": "digits"}, "max_steps": 10, **budgets})
    engine = Engine()
    ctx = RunContext("run", cfg, Chat(), engine, DigitsAgent, None, asyncio.Lock())
    task = RolloutTask(run_id="run", task_id="t", sample_idx=0, task={"first": "seven", "offsets": [1]},
                       dispatched_at=time.time())
    return asyncio.run(run_episode(ctx, Envs(), task, "w", error_retries=0)), engine


def test_a_prompt_that_fills_the_context_ends_the_episode_with_its_steps_kept():
    # turn 1: prompt "user: seven\nassistant: " (23) + 16; turn 2: 23 + 16 + "\nuser: one\nassistant: " (22) = 61,
    # 3 tokens of room; turn 3: 61 + 3 + 22 = 86 > 64, no room
    result, engine = episode(max_prompt_tokens=32, max_response_tokens=16, max_context_tokens=64)
    assert engine.calls == [(23, 16), (61, 3)]
    assert (result.status, result.termination_reason) == ("completed", TR.CONTEXT_EXCEEDED)
    [traj] = result.trajectories
    assert traj.termination_reason == TR.CONTEXT_EXCEEDED and len(traj.steps) == 2
    assert all(len(s.prompt_ids) + len(s.response_ids) <= 64 for s in traj.steps)
    assert any(traj.loss_mask)  # the assembled tokens are intact: the trainer, not the worker, masks them
    [sample] = samples_from_result(result)
    assert sample.masked == "context_exceeded" and not any(sample.loss_mask)
    assert len(sample.response_ids) == len(traj.response_ids)  # kept whole, only without loss
    [trained] = samples_from_result(result, mask_termination=[])
    assert trained.masked is None and trained.loss_mask == traj.loss_mask


def test_without_a_context_window_the_same_episode_runs_to_max_steps():
    result, engine = episode(max_prompt_tokens=32, max_response_tokens=16)
    assert result.termination_reason == TR.MAX_STEPS and len(engine.calls) == 10
    assert all(max_tokens == 16 for _, max_tokens in engine.calls)


@pytest.mark.parametrize("budgets, reason, calls", [
    # turn 2: the trajectory's budget binds (9 left, 39 in the context): the cut response ends the episode
    ({"max_trajectory_tokens": 70, "max_context_tokens": 100}, TR.RESPONSE_TRUNCATION, [(23, 16), (61, 9)]),
    # turn 2: the context binds (3 < 16): the episode goes on; turn 3 (86) fits neither, the context window is named
    ({"max_trajectory_tokens": 80, "max_context_tokens": 64}, TR.CONTEXT_EXCEEDED, [(23, 16), (61, 3)]),
    ({"max_trajectory_tokens": 61}, TR.PROMPT_TRUNCATION, [(23, 16)]),  # nothing left of the trajectory's budget
])
def test_trajectory_budget_and_context_window_together(budgets, reason, calls):
    result, engine = episode(max_prompt_tokens=32, max_response_tokens=16, **budgets)
    assert result.termination_reason == reason and engine.calls == calls


class PartialEngine(Engine):
    """A partial rollout's engine: version 1 arrives three tokens into every generation."""

    def __init__(self):
        super().__init__()
        self.sampling = []

    async def generate(self, prompt_ids, sampling, max_tokens):
        self.sampling.append(sampling)
        ids = [ord("7")] * 5
        return Generation(ids=ids, logprobs=[-0.1] * 5, text="77777", finish_reason="length", weight_version=0,
                          versions=[0, 0, 0, 1, 1])


def test_a_partial_rollout_run_asks_for_it_and_tags_its_tokens_one_by_one():
    cfg = RunConfig.model_validate({
        "name": "ctx", "kind": "train", "model": "m", "dataset": "d", "agent": {"name": "digits"},
        "env": {"name": "digits"}, "max_steps": 2, "samples_per_task": 2, "partial_rollout": True})
    engine = PartialEngine()
    ctx = RunContext("run", cfg, Chat(), engine, DigitsAgent, None, asyncio.Lock())
    task = RolloutTask(run_id="run", task_id="t", sample_idx=0, task={"first": "seven", "offsets": [1]},
                       dispatched_at=time.time())
    result = asyncio.run(run_episode(ctx, Envs(), task, "w", error_retries=0)).expanded()
    assert engine.sampling and all(s.partial for s in engine.sampling)
    [traj] = result.trajectories
    assert [s.response_versions for s in traj.steps] == [[0, 0, 0, 1, 1]] * 2
    model = [v for v, m in zip(traj.versions, traj.loss_mask, strict=True) if m]
    assert model == [0, 0, 0, 1, 1] * 2 and traj.policy_versions == (0, 1)
