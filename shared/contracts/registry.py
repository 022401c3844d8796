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
    "math": "shared.builtin.agents:MathAgent",
    "tool": "shared.builtin.agents:ToolAgent",
    "frozenlake": "shared.builtin.agents:FrozenLakeAgent",
    "code": "shared.builtin.agents:CodeAgent",
    "countdown": "shared.builtin.agents:MathAgent",
    "recall": "shared.builtin.recall:RecallAgent",
    "digits": "shared.builtin.agents:DigitsAgent",
}
ENVS: dict[str, str] = {
    "math": "shared.builtin.envs:MathEnv",
    "countdown": "shared.builtin.envs:CountdownEnv",
    "frozenlake": "shared.builtin.envs:FrozenLakeEnv",
    "tool": "shared.builtin.envs:ToolEnv",
    "code": "shared.builtin.envs:CodeEnv",
    "search": "shared.builtin.envs:SearchEnv",
    "recall": "shared.builtin.recall:RecallEnv",
    "digits": "shared.builtin.envs:DigitsEnv",
}
WORKFLOWS: dict[str, str] = {
    "single_agent": "shared.builtin.workflows:SingleAgentWorkflow",
    "solver_judge": "shared.builtin.workflows:SolverJudgeWorkflow",
}
REWARDS: dict[str, str] = {
    "math": "shared.builtin.rewards:math_reward",
    "countdown": "shared.builtin.rewards:countdown_reward",
    "search": "shared.builtin.rewards:search_reward",
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
