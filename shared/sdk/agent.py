"""The public API users write against, compatible with rLLM: `BaseAgent`, `BaseEnv`, `Workflow`.

A user module needs only `from shared.sdk.agent import BaseAgent, BaseEnv, Step, Action, Trajectory, Episode`.
Agents live in rollout workers; environments live in env workers and are built per task with `from_dict`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

from shared.sdk.types import Action, Episode, Step, TerminationReason, Trajectory

__all__ = [
    "Action", "BaseAgent", "BaseEnv", "Episode", "Step", "TerminationReason", "Trajectory", "Workflow",
    "WorkflowTerminated",
]


class BaseAgent(ABC):
    """Turns observations into chat messages and model responses into actions, recording a `Trajectory`."""

    @property
    def chat_completions(self) -> list[dict[str, Any]]:
        """The messages to send to the model next (OpenAI chat format)."""
        return []

    @property
    def trajectory(self) -> Trajectory:
        return Trajectory()

    def update_from_env(self, observation: Any, reward: float, done: bool, info: dict, **kwargs) -> None:
        raise NotImplementedError("Subclasses must implement update_from_env to be driven by the rollout worker")

    def update_from_model(self, response: str, **kwargs) -> Action:
        raise NotImplementedError("Subclasses must implement update_from_model to be driven by the rollout worker")

    @abstractmethod
    def reset(self) -> None: ...

    def get_current_state(self) -> Step | None:
        steps = self.trajectory.steps
        return steps[-1] if steps else None


class BaseEnv(ABC):
    """A gym-like environment hosted by an env worker. `from_dict(task)` builds one instance per rollout."""

    @abstractmethod
    def reset(self) -> tuple[Any, dict]: ...

    @abstractmethod
    def step(self, action: Any) -> tuple[Any, float, bool, dict]: ...

    def close(self) -> None:
        return None

    @staticmethod
    @abstractmethod
    def from_dict(info: dict) -> BaseEnv:
        raise NotImplementedError("Subclasses must implement 'from_dict'")

    # Optional: `compute_final_reward(self) -> float`, called once after the last step when defined.


class WorkflowTerminated(Exception):
    """Raised inside `Workflow.run` to end the episode early with a reason (rLLM's TerminationEvent)."""

    def __init__(self, reason: TerminationReason, message: str = ""):
        super().__init__(message or reason.value)
        self.reason = reason


class Workflow(ABC):
    """A multi-agent episode (rLLM's AgentWorkflowEngine unit): `run(task, uid) -> Episode`.

    The rollout worker gives each workflow a `rollout` handle (model calls and env sessions through the
    platform, token-tagged) as `self.rollout`, and retries episodes that end in ERROR up to the run's limit.
    """

    def __init__(self, rollout: Any = None, **kwargs):
        self.rollout = rollout
        self.kwargs = kwargs

    @abstractmethod
    async def run(self, task: dict, uid: str, **kwargs) -> Episode: ...
