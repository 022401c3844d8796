"""Built-in environments (rLLM-compatible: `from_dict(task | env_args)`, gym-like reset/step).

Each env is built per rollout by an env worker from the dataset row merged with the run's `env.args`.
Single-turn envs (math, countdown) grade the first response and finish; the multi-turn ones (frozenlake,
tool, code with feedback, search) run until solved, failed, or `max_turns`.
"""

from __future__ import annotations

import re
from typing import Any

from shared.agent import BaseEnv
from shared.builtin import rewards
from shared.builtin.sandbox import SandboxLimits, run_python
from shared.builtin.tools import Bm25Index, FinishTool, PythonTool, SearchTool, load_corpus_index


def _response_text(action: Any) -> str:
    if isinstance(action, dict):
        return str(action.get("response") or action.get("content") or "")
    return "" if action is None else str(action)


# `required_fields`: the fields every dataset row (merged with env.args) must have, each entry a tuple of
# alternatives; POST /v1/runs refuses a dataset with rows that lack one, before any rollout.
GROUND_TRUTH = ("ground_truth", "answer", "solution")  # what rewards.ground_truths reads


class SingleTurnEnv(BaseEnv):
    """Shows the task, grades one response with `reward_fn`, done."""

    required_fields: tuple[tuple[str, ...], ...] = ()

    reward_fn = staticmethod(rewards.math_reward)

    def __init__(self, task: dict):
        self.task = task

    def reset(self) -> tuple[dict, dict]:
        return dict(self.task), {}

    def step(self, action: Any) -> tuple[dict, float, bool, dict]:
        out = self.reward_fn(self.task, _response_text(action))
        return {}, out.reward, True, {"is_correct": out.is_correct, **out.metadata}

    @classmethod
    def from_dict(cls, info: dict) -> SingleTurnEnv:
        return cls(dict(info))


class MathEnv(SingleTurnEnv):
    """Question in `question` (or `problem`), reference in `ground_truth`; rewards.math_reward grades."""

    required_fields = (("question", "problem"), GROUND_TRUTH)

    def __init__(self, task: dict):
        if "question" not in task and "problem" in task:
            task = {**task, "question": task["problem"]}
        rewards.ground_truths(task)  # fail at reset, not at grading, when the reference is missing
        super().__init__(task)


class CountdownEnv(SingleTurnEnv):
    reward_fn = staticmethod(rewards.countdown_reward)
    required_fields = (("nums",), ("target",))

    def __init__(self, task: dict):
        for key in ("nums", "target"):
            if key not in task:
                raise ValueError(f"countdown task needs {key!r} (got keys {sorted(task)})")
        super().__init__(task)


class FrozenLakeEnv(BaseEnv):
    """gymnasium FrozenLake on the task's map (`map`: list of rows of S/F/H/G), deterministic by default.

    Actions are the words Left/Down/Right/Up (or gymnasium's ids 0-3). Reward 1 on reaching G."""

    ACTIONS = {"left": 0, "down": 1, "right": 2, "up": 3}
    required_fields = (("map",),)

    def __init__(self, desc: list[str], is_slippery: bool = False, seed: int = 0, max_turns: int = 32):
        from gymnasium.envs.toy_text.frozen_lake import FrozenLakeEnv as GymFrozenLake

        self.env = GymFrozenLake(desc=desc, is_slippery=is_slippery)
        self.desc, self.seed, self.max_turns = desc, seed, max_turns
        self.state, self.turns = 0, 0

    def render_text(self) -> str:
        ncol = len(self.desc[0])
        row, col = divmod(self.state, ncol)
        rows = [list(r) for r in self.desc]
        rows[row][col] = "P"
        return "\n".join("".join(r) for r in rows)

    def reset(self) -> tuple[dict, dict]:
        self.state, _ = self.env.reset(seed=self.seed)
        self.turns = 0
        return {"grid": self.render_text()}, {}

    def step(self, action: Any) -> tuple[dict, float, bool, dict]:
        self.turns += 1
        move = self.parse_action(action)
        if move is None:
            done = self.turns >= self.max_turns
            return {"grid": self.render_text(), "error": "invalid action"}, 0.0, done, {"invalid": True}
        self.state, reward, terminated, truncated, _ = self.env.step(move)
        done = terminated or truncated or self.turns >= self.max_turns
        return {"grid": self.render_text()}, float(reward), bool(done), {"is_correct": reward > 0}

    def parse_action(self, action: Any) -> int | None:
        if isinstance(action, int) and 0 <= action < 4:
            return action
        return self.ACTIONS.get(str(action).strip().lower())

    @staticmethod
    def from_dict(info: dict) -> FrozenLakeEnv:
        if "map" not in info:
            raise ValueError("frozenlake task needs 'map': a list of rows like ['SFFF', 'FHFH', 'FFFH', 'HFFG']")
        return FrozenLakeEnv(list(info["map"]), bool(info.get("is_slippery", False)), int(info.get("seed", 0)),
                             int(info.get("max_turns", 32)))


class ToolEnv(BaseEnv):
    """Multi-turn tool use. An action is {"tool_calls": [{"name", "arguments"}]} (tools run, their outputs are
    the next observation) or a final response string (graded with `reward_fn`, done). As in rLLM, every tool env
    also offers `finish`: a call to it ends the episode, its `response` argument graded as the final response
    (other calls in the same turn are not run)."""

    required_fields = (GROUND_TRUTH,)

    def __init__(self, task: dict, tools: dict[str, Any], reward_fn=rewards.math_reward, max_turns: int = 5):
        self.task, self.reward_fn, self.max_turns = task, reward_fn, max_turns
        self.tools = {**tools, FinishTool.name: FinishTool()}
        self.turns = 0

    def reset(self) -> tuple[dict, dict]:
        self.turns = 0
        return {**self.task, "tools": [t.schema for t in self.tools.values()]}, {}

    def step(self, action: Any) -> tuple[dict, float, bool, dict]:
        self.turns += 1
        calls = action.get("tool_calls") if isinstance(action, dict) else None
        if not calls:
            return self.finish(_response_text(action))
        finish = next((c for c in calls if isinstance(c, dict) and c.get("name") == FinishTool.name), None)
        if finish is not None:
            return self.finish(FinishTool.final_response(finish.get("arguments")), via_tool=True)
        outputs = [{"name": c.get("name"), "content": self.call_tool(c)} for c in calls]
        return {"tool_outputs": outputs}, 0.0, self.turns >= self.max_turns, {"num_tool_calls": len(calls)}

    def finish(self, response: str, via_tool: bool = False) -> tuple[dict, float, bool, dict]:
        out = self.reward_fn(self.task, response)
        info = {"is_correct": out.is_correct, **out.metadata}
        return {}, out.reward, True, ({**info, "finished_by": "finish_tool"} if via_tool else info)

    def call_tool(self, call: dict) -> str:
        tool = self.tools.get(call.get("name"))
        if tool is None:
            return f"Error: unknown tool {call.get('name')!r}; available: {', '.join(self.tools)}"
        args = call.get("arguments") or {}
        if not isinstance(args, dict):
            return "Error: tool arguments must be a JSON object"
        return tool(**args)

    @staticmethod
    def from_dict(info: dict) -> ToolEnv:
        rewards.ground_truths(info)
        return ToolEnv(dict(info), {"python": PythonTool()}, max_turns=int(info.get("max_turns", 5)))


class CodeEnv(BaseEnv):
    """Runs the response's last ```python block followed by the task's `tests` (assert statements) in the
    sandbox. Reward 1 when everything passes; with `max_turns` > 1 a failure is shown as feedback."""

    required_fields = (("tests",),)
    CODE_BLOCK = re.compile(r"```(?:python|py)?\n(.*?)```", re.S)

    def __init__(self, task: dict, max_turns: int = 1, limits: SandboxLimits | None = None):
        if not task.get("tests"):
            raise ValueError("code task needs 'tests': Python code with assert statements")
        self.task, self.max_turns = task, max_turns
        self.limits = limits or SandboxLimits(wall_s=10, cpu_s=10, memory_bytes=1 << 30)
        self.turns = 0

    def reset(self) -> tuple[dict, dict]:
        self.turns = 0
        return dict(self.task), {}

    def extract_code(self, response: str) -> str:
        text = rewards.final_answer_text(response) or ""
        blocks = self.CODE_BLOCK.findall(text)
        return blocks[-1] if blocks else text

    def step(self, action: Any) -> tuple[dict, float, bool, dict]:
        self.turns += 1
        tests = self.task["tests"]
        program = self.extract_code(_response_text(action)) + "\n\n" + (
            "\n".join(tests) if isinstance(tests, list) else tests)
        result = run_python(program, limits=self.limits)
        info = {"is_correct": result.ok, "error": result.error, "duration_s": result.duration_s}
        if result.ok or self.turns >= self.max_turns:
            return {}, float(result.ok), True, info
        feedback = f"Your code failed the tests: {result.error}\n{result.stderr[-1500:]}"
        return {"feedback": feedback}, 0.0, False, info

    @staticmethod
    def from_dict(info: dict) -> CodeEnv:
        return CodeEnv(dict(info), max_turns=int(info.get("max_turns", 1)))


class SearchEnv(ToolEnv):
    """Question answering with a `search` tool (BM25 over a local corpus). The corpus is the task's
    `corpus` (list of {"title", "text"}) or the jsonl file `corpus_path`. Reward: exact match, or token F1
    with `metric: f1`."""

    @staticmethod
    def from_dict(info: dict) -> SearchEnv:
        if info.get("corpus"):
            index = Bm25Index(list(info["corpus"]))
        elif info.get("corpus_path"):
            index = load_corpus_index(str(info["corpus_path"]))
        else:
            raise ValueError("search env needs 'corpus' (list of documents) or 'corpus_path' (a jsonl file)")
        rewards.ground_truths(info)
        metric = info.get("metric", "em")
        task = {k: v for k, v in info.items() if k != "corpus"}
        return SearchEnv(task, {"search": SearchTool(index, int(info.get("top_k", 3)))},
                         reward_fn=lambda t, r: rewards.search_reward(t, r, metric=metric),
                         max_turns=int(info.get("max_turns", 5)))
