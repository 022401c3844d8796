"""The task a tiny random-init model learns by RL in minutes on a CPU: name a digit. The prompt is a number
word ("seven"), the one-token answer its digit ("7").

The answer depends on the prompt: a policy that ignores the prompt scores at most 1/10, so a reward of 0.8
needs the model to read the question. The agent, env and dataset generator `recall` and the tiny number model
share this task's words, rows and reward.

More: docs/agents-and-envs.md#the-recall-task
"""

from __future__ import annotations

import random

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
