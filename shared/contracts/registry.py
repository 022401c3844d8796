"""Named components (agents, envs, workflows, rewards) resolved by registered name or import path.

Registries hold import paths, not classes, so naming a built-in never imports gymnasium or torch until a
worker needs it. A user plugs in their own class as `"my_pkg.envs:MyEnv"`.
"""

from __future__ import annotations

import importlib
import re
from typing import Any

IMPORT_PATH = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_][\w.]*$")

AGENTS: dict[str, str] = {
    "math": "services.rollout_worker.builtin.agents:MathAgent",
    "tool": "services.rollout_worker.builtin.agents:ToolAgent",
    "frozenlake": "services.rollout_worker.builtin.agents:FrozenLakeAgent",
    "code": "services.rollout_worker.builtin.agents:CodeAgent",
    "countdown": "services.rollout_worker.builtin.agents:MathAgent",
    "recall": "services.rollout_worker.builtin.agents:RecallAgent",
    "digits": "services.rollout_worker.builtin.agents:DigitsAgent",
}
ENVS: dict[str, str] = {
    "math": "services.env_worker.builtin.envs:MathEnv",
    "countdown": "services.env_worker.builtin.envs:CountdownEnv",
    "frozenlake": "services.env_worker.builtin.envs:FrozenLakeEnv",
    "tool": "services.env_worker.builtin.envs:ToolEnv",
    "code": "services.env_worker.builtin.envs:CodeEnv",
    "search": "services.env_worker.builtin.envs:SearchEnv",
    "recall": "services.env_worker.builtin.envs:RecallEnv",
    "digits": "services.env_worker.builtin.envs:DigitsEnv",
}
# Built-in envs that run model-written code (`runs_model_code`): the run config gives them an explicit `sandbox`
# arg without importing them (a test checks this set against the envs).
MODEL_CODE_ENVS = frozenset({"tool", "search", "code"})
WORKFLOWS: dict[str, str] = {
    "single_agent": "services.rollout_worker.builtin.workflows:SingleAgentWorkflow",
    "solver_judge": "services.rollout_worker.builtin.workflows:SolverJudgeWorkflow",
}
REWARDS: dict[str, str] = {
    "math": "services.env_worker.builtin.rewards:math_reward",
    "countdown": "services.env_worker.builtin.rewards:countdown_reward",
    "search": "services.env_worker.builtin.rewards:search_reward",
}
# Agent programs (any framework, calling the OpenAI-compatible gateway): `async def run(task, client) -> reward`.
# "external": the program runs anywhere; it claims sessions from a rollout worker's gateway and posts rewards.
AGENT_PROGRAMS: dict[str, str] = {"external": "shared.contracts.registry:EXTERNAL_AGENT_PROGRAM"}
EXTERNAL_AGENT_PROGRAM = "external"
REGISTRIES = {"agent": AGENTS, "env": ENVS, "workflow": WORKFLOWS, "reward": REWARDS,
              "agent_program": AGENT_PROGRAMS}


def import_path_for(kind: str, name: str) -> str:
    """Map a registered name or an import path to an import path; raise ValueError naming the choices."""
    registry = REGISTRIES[kind]
    if name in registry:
        return registry[name]
    if IMPORT_PATH.match(name):
        return name
    raise ValueError(
        f"unknown {kind} {name!r}: use a registered name ({', '.join(sorted(registry))}) "
        f"or an import path 'package.module:Class'"
    )


def resolve(kind: str, name: str) -> Any:
    """Import and return the object a name or import path refers to."""
    path = import_path_for(kind, name)
    module_name, _, attr = path.partition(":")
    try:
        obj: Any = importlib.import_module(module_name)
    except ImportError as e:
        raise ValueError(f"{kind} {name!r}: cannot import module {module_name!r} ({e})") from e
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ValueError(f"{kind} {name!r}: module {module_name!r} has no attribute {attr!r}")
        obj = getattr(obj, part)
    return obj
