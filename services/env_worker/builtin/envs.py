"""Built-in environments (rLLM-compatible: `from_dict(task | env_args)`, gym-like reset/step).

Each env is built per rollout by an env worker from the dataset row merged with the run's `env.args`.
Single-turn envs (math, countdown) grade the first response and finish; the multi-turn ones (frozenlake,
tool, code with feedback, search) run until solved, failed, or `max_turns`; digits runs a fixed number of turns
and rewards at the end.
"""

from __future__ import annotations

import re
import uuid
from typing import Any

from services.env_worker.builtin import rewards
from services.env_worker.builtin.tools import Bm25Index, FinishTool, PythonTool, SearchTool, load_corpus_index
from services.env_worker.sandbox import (
    DEFAULT_MODE,
    SandboxLimits,
    container_session,
    run_python,
    sandbox_mode,
)
from shared.sdk.agent import BaseEnv
from shared.tasks.recall import WORDS as NUMBER_WORDS
from shared.tasks.recall import recall_reward


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
    runs_model_code = True  # the python tool: the run config gives it an explicit `sandbox` arg

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
        results = [self.call_tool(c) for c in calls]
        outputs = [{"name": c.get("name"), "content": text} for c, (text, _) in zip(calls, results, strict=True)]
        errors = sum(bad for _, bad in results)
        return ({"tool_outputs": outputs}, 0.0, self.turns >= self.max_turns,
                {"num_tool_calls": len(calls), "tool_call_errors": errors})

    def finish(self, response: str, via_tool: bool = False) -> tuple[dict, float, bool, dict]:
        out = self.reward_fn(self.task, response)
        info = {"is_correct": out.is_correct, **out.metadata}
        return {}, out.reward, True, ({**info, "finished_by": "finish_tool"} if via_tool else info)

    def call_tool(self, call: dict) -> tuple[str, bool]:
        """The tool's output, and whether the call itself was malformed: not JSON, an unknown tool, arguments that
        are not an object, miss a required one or name one the tool does not take. A malformed call is an
        observation the agent sees (the model learns the format), never an env error, and is counted in the
        step's `tool_call_errors`."""
        name = call.get("name") if isinstance(call, dict) else None
        if name == "invalid_tool_call":  # services/rollout_worker/builtin/agents.py: parse_tool_calls
            return (f"Error: the tool call is not valid JSON ({call.get('error')}); write "
                    '<tool_call>{"name": ..., "arguments": {...}}</tool_call>'), True
        tool = self.tools.get(name)
        if tool is None:
            return f"Error: unknown tool {name!r}; available: {', '.join(self.tools)}", True
        args = call.get("arguments") or {}
        if not isinstance(args, dict):
            return "Error: tool arguments must be a JSON object", True
        params = tool.schema["function"].get("parameters", {})
        missing = [k for k in params.get("required", []) if k not in args]
        unknown = [k for k in args if "properties" in params and k not in params["properties"]]
        if missing or unknown:
            wrong = "; ".join(f"{what}: {', '.join(keys)}" for what, keys in (("missing", missing),
                                                                            ("not taken", unknown)) if keys)
            takes = ", ".join(params.get("properties", {})) or "no arguments"
            return f"Error: wrong arguments for {name} ({wrong}); it takes {takes}", True
        return tool(**args), False

    @staticmethod
    def from_dict(info: dict) -> ToolEnv:
        rewards.ground_truths(info)
        return ToolEnv(dict(info), {"python": PythonTool(sandbox=info.get("sandbox"), image=info.get("image"))},
                       max_turns=int(info.get("max_turns", 5)))


class CodeEnv(BaseEnv):
    """Grades the response's last ```python block in the sandbox (`sandbox`: namespaces by default; see
    services/env_worker/sandbox/__init__.py). Reward 1 when every test passes; with `max_turns` > 1 a failure is shown as
    feedback. The task's `tests` take one of two forms:

    - assert statements (a string, or a list of strings): run after the solution in one program. Solution and
      tests share an interpreter, so a solution written to subvert them can (see `step`);
    - input/output cases, `[{"input": "...", "output": "..."}, ...]`: the solution alone runs once per case with
      the input on stdin, and its stdout (trailing whitespace ignored) is compared with the expected output here,
      in the env worker. The expected outputs never enter the sandbox: a solution can only pass by printing them.

    The observation (`reset`) is the task without its `tests`."""

    runs_model_code = True  # the run config gives it an explicit `sandbox` arg (see shared/contracts/run_config.py)

    required_fields = (("tests",),)
    CODE_BLOCK = re.compile(r"```(?:python|py)?\n(.*?)```", re.S)

    def __init__(self, task: dict, max_turns: int = 1, limits: SandboxLimits | None = None,
                 sandbox: str = DEFAULT_MODE, image: str | None = None):
        if not task.get("tests"):
            raise ValueError("code task needs 'tests': Python code with assert statements, or a list of "
                             '{"input": ..., "output": ...} cases')
        self.cases = io_cases(task["tests"])
        self.task, self.max_turns, self.sandbox, self.image = task, max_turns, sandbox_mode(sandbox), image
        if self.sandbox == "container" and not image:
            raise ValueError("code env with sandbox 'container' needs `image` (env.args.image), e.g. "
                             "localhost/flywheel-sandbox-python:local (make sandbox-image)")
        self.container = None  # mode container: this session's container, from the warm pool at the first step
        self.limits = limits or SandboxLimits(wall_s=10, cpu_s=10, memory_bytes=1 << 30)
        self.turns = 0

    def reset(self) -> tuple[dict, dict]:
        self.turns = 0
        return {k: v for k, v in self.task.items() if k != "tests"}, {}

    def extract_code(self, response: str) -> str:
        text = rewards.final_answer_text(response) or ""
        blocks = self.CODE_BLOCK.findall(text)
        return blocks[-1] if blocks else text

    def step(self, action: Any) -> tuple[dict, float, bool, dict]:
        self.turns += 1
        code = self.extract_code(_response_text(action))
        passed, result, failure = self.judge_cases(code) if self.cases else self.judge_asserts(code)
        info = {"is_correct": passed, "error": failure.splitlines()[0] if failure else None,
                "duration_s": result.duration_s, "sandbox": result.mode}
        if passed or self.turns >= self.max_turns:
            return {}, float(passed), True, info
        return {"feedback": f"Your code failed the tests: {failure}"}, 0.0, False, info

    def run(self, program: str, stdin: str = ""):
        if self.sandbox == "container":
            if self.container is None:
                self.container = container_session(self.image, self.limits)
            return self.container.run_python(program, stdin=stdin, limits=self.limits)  # SandboxInfraError: not a score
        return run_python(program, stdin=stdin, limits=self.limits, mode=self.sandbox)

    def judge_cases(self, code: str):
        """(passed, last result, failure): the first case that fails ends the judging."""
        for k, case in enumerate(self.cases, 1):
            result = self.run(code, case["input"])
            if not result.ok:
                return False, result, f"case {k}: {result.error}\n{result.stderr[-1500:]}"
            if _lines(result.stdout) != _lines(case["output"]):
                return False, result, (f"case {k}: wrong output for input {case['input'][:300]!r}: "
                                       f"got {result.stdout[:300]!r}")
        return True, result, ""

    def judge_asserts(self, code: str):
        tests = self.task["tests"]
        # The tests must run to their end: a solution that exits (sys.exit(0), os._exit(0)) before the asserts
        # exits 0 too. A per-step token written (to stderr, which a passing run leaves nearly empty, so the
        # output cap does not cut it) after the last assert tells a finished run from that shortcut
        # (a solution written to find the token in its own source could still forge it: see docs/security.md).
        token = f"fw-tests-passed-{uuid.uuid4().hex}"
        program = code + "\n\n" + (
            "\n".join(tests) if isinstance(tests, list) else tests) + f"\nimport sys\nsys.stderr.write({token!r})\n"
        result = self.run(program)
        passed = result.ok and token in result.stderr
        if result.ok and not passed:
            result.exit_code, result.stderr = 1, result.stderr + "\nthe tests did not run to their end (the program exited early)"
        return passed, result, "" if passed else f"{result.error}\n{result.stderr[-1500:]}"

    def close(self) -> None:
        if self.container is not None:
            self.container.close()
            self.container = None

    @staticmethod
    def from_dict(info: dict) -> CodeEnv:
        return CodeEnv(dict(info), max_turns=int(info.get("max_turns", 1)), sandbox=info.get("sandbox"),
                       image=info.get("image"))


def io_cases(tests: Any) -> list[dict] | None:
    """`tests` as input/output cases ({"input": str, "output": str}; input defaults to ""), or None when they are
    assert statements. ValueError, saying what is wrong, for anything else."""
    if isinstance(tests, str) or (isinstance(tests, list) and all(isinstance(t, str) for t in tests)):
        return None
    if not isinstance(tests, list) or not all(isinstance(t, dict) and isinstance(t.get("output"), str)
                                              and isinstance(t.get("input", ""), str) for t in tests):
        raise ValueError("code task 'tests' must be assert statements (a string or a list of strings) or a list of "
                         '{"input": "<stdin>", "output": "<expected stdout>"} cases with string values')
    return [{"input": t.get("input", ""), "output": t["output"]} for t in tests]


def _lines(text: str) -> list[str]:
    return [line.rstrip() for line in text.rstrip().splitlines()]


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




class DigitsEnv(BaseEnv):
    """Multi-turn, reward at the end: each turn the env says a number word ("seven") and the model answers its
    digit ("7"). The next word is (the digit the model answered + the task's secret offset for that turn) mod 10,
    so what the env says depends on the model's previous action, and the right answer of every turn depends
    on what the env said just before it. After the last turn the reward is the share of turns answered right
    (`all_or_nothing: true`: 1 only when every turn is right); earlier turns get 0. Each step's info has
    `correct` (that turn) and the last one `is_correct` (every turn right) and `turns_right`.

    Why it is learnable: every turn is one next-token choice among ten digits, and one mapping word -> digit
    serves every turn, so a tiny random-init model finds it from the partial credit of single right turns.
    Why it is not a bandit: the words of turns 2.. come from the model's own earlier answers and from offsets
    it never sees, so an answer can only be right by reading the newest env message inside a context that
    holds earlier words and answers, and the reward, given once at the end, has to be credited across turns.
    A policy that ignores the env scores 0.1; one that learned only the first turn scores about 0.4."""

    required_fields = (("first",), ("offsets",))

    def __init__(self, first: str, offsets: list[int], all_or_nothing: bool = False):
        if first not in NUMBER_WORDS:
            raise ValueError(f"digits task: 'first' must be a number word ({', '.join(NUMBER_WORDS)}), got {first!r}")
        if not isinstance(offsets, list | tuple) or not all(isinstance(o, int) for o in offsets):
            raise ValueError(f"digits task: 'offsets' must be a list of integers (one per turn after the first; "
                             f"empty: a one-turn task), got {offsets!r}; rows come from "
                             "services.jobs.builtin_datasets.generate('digits')")
        self.first, self.offsets, self.all_or_nothing = first, list(offsets), all_or_nothing
        self.word, self.right = first, []

    @property
    def turns(self) -> int:
        return len(self.offsets) + 1

    def reset(self) -> tuple[dict, dict]:
        self.word, self.right = self.first, []
        return {"word": self.word}, {}

    def step(self, action: Any) -> tuple[dict, float, bool, dict]:
        digit = NUMBER_WORDS.index(self.word)
        answer = _response_text(action).strip()
        correct = answer == str(digit)
        self.right.append(correct)
        turn = len(self.right)
        if turn >= self.turns:
            reward = float(all(self.right)) if self.all_or_nothing else sum(self.right) / self.turns
            return {}, reward, True, {"correct": correct, "turn": turn, "is_correct": all(self.right),
                                      "turns_right": sum(self.right)}
        answered = int(answer) if answer.isdigit() and len(answer) == 1 else digit  # a non-digit: the right one
        self.word = NUMBER_WORDS[(answered + self.offsets[turn - 1]) % 10]
        return {"word": self.word}, 0.0, False, {"correct": correct, "turn": turn}

    @staticmethod
    def from_dict(info: dict) -> DigitsEnv:
        for key in ("first", "offsets"):
            if key not in info:
                raise ValueError(f"digits task needs {key!r} (got keys {sorted(info)}); rows come from "
                                 "services.jobs.builtin_datasets.generate('digits', n)")
        return DigitsEnv(str(info["first"]), list(info["offsets"]), bool(info.get("all_or_nothing", False)))


class RecallEnv(BaseEnv):
    """One step: shows the question, rewards the response with `recall_reward`, done. The env arg `offset` k makes
    a variant of the task on the same data: the right answer is (digit + k) mod 10, so runs that each learn their
    own k on one base tell their adapters apart (another run's adapter scores near 0)."""

    required_fields = (("question",), ("answer",))

    def __init__(self, task: dict, offset: int = 0):
        for key in ("question", "answer"):
            if key not in task:
                raise ValueError(f"recall task needs {key!r} (got keys {sorted(task)}); generate rows with "
                                 f"`flywheel datasets import recall --generator --name recall`")
        if offset:
            task = {**task, "answer": str((int(task["answer"]) + offset) % len(NUMBER_WORDS))}
        self.task = task

    def reset(self) -> tuple[Any, dict]:
        return self.task["question"], {}

    def step(self, action: Any) -> tuple[Any, float, bool, dict]:
        reward = recall_reward(self.task["answer"], str(action or ""))
        return "", reward, True, {"is_correct": reward > 0}

    @staticmethod
    def from_dict(info: dict) -> RecallEnv:
        return RecallEnv(dict(info), offset=int(info.get("offset", 0)))
