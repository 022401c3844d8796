"""The demo's task: name a digit. The prompt is a number word ("seven"), the one-token answer its digit ("7").

The task itself is the built-in `recall` (shared/tasks/recall.py; its agent and env live in the rollout and env
workers); the demo plugs its components in by import path, as any user's own would be:
    "env": {"name": "tests.support.recall:RecallEnv"}, "agent": {"name": "tests.support.recall:RecallAgent"}
and trains the tiny random-init model whose tokenizer knows exactly this task's words
(tests.support.tiny_model.build_number_model, which bench/demo_agent.py imports from here as `build_tiny_model`).
"""

from __future__ import annotations

from services.env_worker.builtin.envs import RecallEnv  # noqa: F401  (this module's names, used by the demo)
from services.rollout_worker.builtin.agents import RecallAgent  # noqa: F401
from shared.tasks.recall import ANSWERS, CHANCE, WORDS, dataset_rows, recall_reward  # noqa: F401
from tests.support.tiny_model import build_number_model as build_tiny_model  # noqa: F401  (bench/demo_agent.py's name)
