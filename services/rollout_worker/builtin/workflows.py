"""Built-in workflows (rLLM's AgentWorkflowEngine units): `await Workflow.run(task, uid) -> Episode`.

A workflow drives agents through `self.rollout`, the handle the rollout worker gives it:

    rollout.make_agent() -> BaseAgent              # the run's configured agent
    await rollout.run_agent(agent, task, name=..., env=None | (env_name, env_args)) -> Trajectory
        # the agent loop: env session on an env worker, model calls token-tagged, termination reason set

`run_agent` raises `WorkflowTerminated(INFRA_ERROR)` when infrastructure fails; any other exception ends the
episode with ERROR (retried by the worker up to its limit).
"""

from __future__ import annotations

import asyncio
import re

from services.rollout_worker.builtin.agents import MathAgent
from shared.sdk.agent import Episode, TerminationReason, Trajectory, Workflow


def episode_from(uid: str, task: dict, trajectories: list[Trajectory], final: Trajectory) -> Episode:
    return Episode(
        id=uid, task=task, termination_reason=final.termination_reason, trajectories=trajectories,
        is_correct=bool(final.info.get("is_correct", (final.reward or 0) > 0)),
        metrics={"num_trajectories": len(trajectories), "num_steps": sum(len(t.steps) for t in trajectories)},
    )


class SingleAgentWorkflow(Workflow):
    """One agent, one env: the plain agent loop as an episode with one trajectory."""

    async def run(self, task: dict, uid: str, **kwargs) -> Episode:
        traj = await self.rollout.run_agent(self.rollout.make_agent(), task, name="agent")
        return episode_from(uid, task, [traj], traj)


JUDGE_PROMPT = """Problem:
{question}

Candidate solutions:
{candidates}

Which candidate's final answer is correct? Reply with its number inside \\boxed{{}}, e.g. \\boxed{{1}}."""


class SolverJudgeWorkflow(Workflow):
    """The solver proposes `num_solutions` answers (one trajectory each, graded by the run's env); the judge
    reads them and picks one (its trajectory is graded on whether the pick is correct). The episode holds
    the solver trajectories and the judge trajectory."""

    def __init__(self, rollout=None, num_solutions: int = 2, **kwargs):
        super().__init__(rollout, **kwargs)
        if num_solutions < 1:
            raise ValueError("num_solutions must be >= 1")
        self.num_solutions = num_solutions

    async def run(self, task: dict, uid: str, **kwargs) -> Episode:
        solvers = await asyncio.gather(*[
            self.rollout.run_agent(self.rollout.make_agent(), task, name="solver")
            for _ in range(self.num_solutions)
        ])
        judge_task = self.judge_task(task, solvers)
        judge = await self.rollout.run_agent(MathAgent(), judge_task, name="judge", env=("math", {}))
        episode = episode_from(uid, task, [*solvers, judge], judge)
        episode.metrics["solver_acc"] = sum(bool(t.info.get("is_correct")) for t in solvers) / len(solvers)
        episode.metrics["judge_acc"] = float(episode.is_correct)
        return episode

    def judge_task(self, task: dict, solvers: list[Trajectory]) -> dict:
        answers = [t.steps[-1].model_response if t.steps else "" for t in solvers]
        candidates = "\n\n".join(f"Candidate {i + 1}:\n{_tail(a)}" for i, a in enumerate(answers))
        correct = [str(i + 1) for i, t in enumerate(solvers) if t.info.get("is_correct")] or ["none"]
        question = task.get("question") or task.get("problem") or ""
        return {"question": JUDGE_PROMPT.format(question=question, candidates=candidates), "ground_truth": correct}


def _tail(text: str, limit: int = 1500) -> str:
    """The end of a solution (where the answer is), without the thinking."""
    text = re.sub(r"<think>.*?</think>", "", text, flags=re.S).strip()
    return text[-limit:]


__all__ = ["SingleAgentWorkflow", "SolverJudgeWorkflow", "TerminationReason"]
