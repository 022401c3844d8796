"""README's "The first ten minutes", end to end: the local stack (`make up`), the tiny model built where the
examples name it (`.data/models/tiny-qwen2`, relative to the repo root), datasets from the built-in generators,
then with the CLI only a finished evaluation (pass@k table) and a finished training run (the example config
with fewer steps, so the test ends in minutes on a CPU).

    pytest -q -m slow tests/integration/test_first_steps.py
"""

from __future__ import annotations

import re

import pytest
import yaml
from api_testlib import REPO
from typer.testing import CliRunner

from harness.stack import LocalStack
from services.api.cli import app

TOKEN = "first-steps-token-0123"
MODEL = REPO / ".data/models/tiny-qwen2"  # what the README builds; .data/ is git-ignored


@pytest.fixture(scope="module")
def stack(isolated_urls, tmp_path_factory):
    redis_url, database_url = isolated_urls
    if not (MODEL / "config.json").exists():
        from harness.tiny_model import build_tiny_model

        build_tiny_model(MODEL)
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
def test_readme_path_from_make_up_to_a_finished_eval_and_training_run(cli, tmp_path):
    assert "math-tiny/test: 8 rows" in cli("datasets", "import", "arithmetic", "--generator", "--name", "math-tiny",
                                           "--split", "test", "--n", "8")
    out = cli("eval", "-f", str(REPO / "examples/eval_math_hf.yaml"), "--interval-s", "2")
    assert "ended: completed" in out and "pass@k" in out, out
    run_id = re.search(r"eval run id=(\S+)", out)[1]
    assert "samples 32 = completed 32" in cli("runs", "show", run_id)

    assert "countdown/train: 16 rows" in cli("datasets", "import", "countdown", "--generator", "--name", "countdown",
                                             "--n", "16")
    config = yaml.safe_load((REPO / "examples/train_countdown_grpo.yaml").read_text())
    assert config["model"] == ".data/models/tiny-qwen2"  # relative: resolved against the repo root
    config |= {"total_steps": 2, "tasks_per_batch": 2, "samples_per_task": 2, "max_response_tokens": 32}
    (tmp_path / "train.yaml").write_text(yaml.safe_dump(config))
    out = cli("runs", "start", "-f", str(tmp_path / "train.yaml"), "--watch")
    assert "ended: completed" in out, out
    assert "2/2 steps" in out
