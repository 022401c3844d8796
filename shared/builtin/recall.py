"""The task a tiny random-init model learns by RL in minutes on a CPU: name a digit. The prompt is a number
word ("seven"), the one-token answer its digit ("7").

The answer depends on the prompt: a policy that ignores the prompt scores at most 1/10 (always answering the
most frequent digit of a uniform task mix), so a reward of 0.8 needs the model to read the question.

Registered as agent and env `recall` and as the built-in dataset generator `recall`; the model whose
tokenizer knows exactly this task's words is `python -m harness.tiny_model --number FOLDER`
(harness.tiny_model.build_number_model). `make demo`, `examples/train_recall_grpo.yaml` and the trainer tests
train on it.
"""

from __future__ import annotations

import random
from typing import Any

from shared.sdk.agent import Action, BaseAgent, BaseEnv, Step, Trajectory

WORDS = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine")
ANSWERS = {word: str(digit) for digit, word in enumerate(WORDS)}
CHANCE = 1 / len(WORDS)  # the best score of an answer that ignores the prompt, on a uniform task mix


def dataset_rows(n: int, seed: int = 0) -> list[dict]:
    """n tasks {"task_id", "question", "answer"}: each run of ten consecutive rows holds every question once,
    shuffled, so any batch of consecutive rows is close to a uniform mix. Row i does not depend on n."""
    words: list[str] = []
    for block in range((n + len(WORDS) - 1) // len(WORDS)):
        words += random.Random(seed * 1_000_003 + block).sample(WORDS, len(WORDS))
    return [{"task_id": f"r{i}", "question": w, "answer": ANSWERS[w]} for i, w in enumerate(words[:n])]


def recall_reward(answer: str, response: str) -> float:
    """1.0 when the response is exactly the answer's digit (surrounding whitespace aside), else 0.0."""
    return float(response.strip() == answer)


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
            task = {**task, "answer": str((int(task["answer"]) + offset) % len(WORDS))}
        self.task = task

    def reset(self) -> tuple[Any, dict]:
        return self.task["question"], {}

    def step(self, action: Any) -> tuple[Any, float, bool, dict]:
        reward = recall_reward(self.task["answer"], str(action or ""))
        return "", reward, True, {"is_correct": reward > 0}

    @staticmethod
    def from_dict(info: dict) -> RecallEnv:
        return RecallEnv(dict(info), offset=int(info.get("offset", 0)))


class RecallAgent(BaseAgent):
    """Sends the question alone as the user message (the number model's tokenizer knows no other words) and
    acts with the model's text."""

    def __init__(self, **_: Any):
        self._trajectory = Trajectory()
        self._messages: list[dict] = []

    @property
    def chat_completions(self) -> list[dict]:
        return self._messages

    @property
    def trajectory(self) -> Trajectory:
        return self._trajectory

    def reset(self) -> None:
        self._trajectory, self._messages = Trajectory(), []

    def update_from_env(self, observation: Any, reward: float, done: bool, info: dict, **kwargs) -> None:
        if self._trajectory.steps:
            self._trajectory.steps[-1].reward, self._trajectory.steps[-1].done = reward, done
        if observation:
            self._messages.append({"role": "user", "content": str(observation)})

    def update_from_model(self, response: str, **kwargs) -> Action:
        self._trajectory.steps.append(Step(chat_completions=list(self._messages), model_response=response,
                                           action=response))
        self._messages.append({"role": "assistant", "content": response})
        return Action(response)
