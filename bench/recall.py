"""The demo's task: name a digit. The prompt is a number word ("seven"), the one-token answer its digit ("7").

The task itself is the built-in `recall` (shared/builtin/recall.py: agent, env and dataset generator of that
name); the demo plugs its components in by import path, as any user's own would be:
    "env": {"name": "bench.recall:RecallEnv"}, "agent": {"name": "bench.recall:RecallAgent"}
and trains the tiny random-init model whose tokenizer knows exactly this task's words
(harness.tiny_model.build_number_model, which bench/demo_agent.py imports from here as `build_tiny_model`).
"""

from __future__ import annotations

from harness.tiny_model import build_number_model as build_tiny_model  # noqa: F401  (bench/demo_agent.py's name)
from shared.builtin.recall import (  # noqa: F401  (this module's names, used by the demo and the tests)
    ANSWERS,
    CHANCE,
    WORDS,
    RecallAgent,
    RecallEnv,
    dataset_rows,
    recall_reward,
)
