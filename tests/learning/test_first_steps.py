"""README's "The first ten minutes", end to end: the local stack (`make up`), the tiny models built where the
examples name them (`.data/models/tiny-qwen2`, `.data/models/tiny-number`, relative to the repo root), datasets
from the built-in generators, then with the CLI only a finished evaluation (pass@k table), the recall training
example as the README runs it, whose reward must climb from chance to >= 0.6 (it ends near 0.95), the run
addressed by its name, and the countdown example cut short with --set (so it ends in seconds on a CPU).

    pytest -q -m slow tests/learning/test_first_steps.py
"""

from __future__ import annotations

import re

import pytest
import yaml
from api_testlib import REPO
from typer.testing import CliRunner

from infra.local.stack import LocalStack
from services.api.cli import app

TOKEN = "first-steps-token-0123"
MODEL = REPO / ".data/models/tiny-qwen2"  # what the README builds; .data/ is git-ignored
NUMBER_MODEL = REPO / ".data/models/tiny-number"


@pytest.fixture(scope="module")
def stack(isolated_urls, tmp_path_factory):
    redis_url, database_url = isolated_urls
    if not (MODEL / "config.json").exists():
        from tests.support.tiny_model import build_tiny_model

        build_tiny_model(MODEL)
    if not (NUMBER_MODEL / "config.json").exists():
        from tests.support.tiny_model import build_number_model

        build_number_model(NUMBER_MODEL)
    env = {"REDIS_URL": redis_url, "DATABASE_URL": database_url, "API_TOKEN": TOKEN}
    with LocalStack(tmp_path_factory.mktemp("first-steps"), env) as s:
        s.start()
        s.wait_healthy(180)
        yield s


@pytest.fixture
def cli(stack, monkeypatch):
    monkeypatch.setenv("FLYWHEEL_API_URL", stack.api_url)
    monkeypatch.setenv("FLYWHEEL_TOKEN", TOKEN)

    def invoke(*args: str) -> str:
        result = CliRunner().invoke(app, list(args), catch_exceptions=False)
        assert result.exit_code == 0, result.output
        return result.output

    return invoke


@pytest.mark.slow
@pytest.mark.timeout(1200)  # 100 policy versions of 256 samples on a CPU: ~2.5 min idle, 15 on a loaded 2-core box
def test_readme_path_from_make_up_to_a_finished_eval_and_a_training_run_that_learns(cli):
    assert "math-tiny/test: 8 rows" in cli("datasets", "import", "arithmetic", "--generator", "--name", "math-tiny",
                                           "--split", "test", "--n", "8")
    out = cli("eval", "-f", str(REPO / "examples/eval_math_hf.yaml"), "--interval-s", "2")
    assert "ended: completed" in out and "pass@k" in out, out
    run_id = re.search(r"eval run id=(\S+)", out)[1]
    assert "samples 32 = completed 32" in cli("runs", "show", run_id)

    assert "recall/train: 200 rows" in cli("datasets", "import", "recall", "--generator", "--name", "recall",
                                           "--n", "200")
    out = cli("runs", "start", "-f", str(REPO / "examples/train_recall_grpo.yaml"), "--watch")
    assert "ended: completed" in out and "100/100 steps" in out, out
    rewards = {int(v): float(r) for v, r in re.findall(r"policy v(\d+): mean reward ([\d.]+)", out)}
    first, last = [rewards[v] for v in sorted(rewards)[:3]], [rewards[v] for v in sorted(rewards)[-3:]]
    assert len(rewards) >= 90 and sum(first) / 3 <= 0.2, rewards  # at chance: the model is random
    assert sum(last) / 3 >= 0.6, rewards  # and it learned: the reward climbed
    shown = cli("runs", "show", "recall-grpo")  # by name, as the README shows
    assert "recall-grpo (train)" in shown and "completed" in shown, shown

    assert "countdown/train: 16 rows" in cli("datasets", "import", "countdown", "--generator", "--name", "countdown",
                                             "--n", "16")
    config = yaml.safe_load((REPO / "examples/train_countdown_grpo.yaml").read_text())
    assert config["model"] == ".data/models/tiny-qwen2"  # relative: resolved against the repo root
    out = cli("runs", "start", "-f", str(REPO / "examples/train_countdown_grpo.yaml"), "--watch",
              *[f"--set={k}={v}" for k, v in
                {"total_steps": 2, "tasks_per_batch": 2, "samples_per_task": 2, "max_response_tokens": 32}.items()])
    assert "ended: completed" in out, out
    assert "2/2 steps" in out
