"""The tinker-cookbook (0.6.1), unmodified, against a flywheel stack: its supervised loop on a conversations file,
and `recipes/math_rl` (env `arithmetic`, renderer `role_colon`, loss `importance_sampling`) through its own CLI,
with nothing changed but the base URL, the model and the renderer.

    pytest -q tests/e2e/test_tinker_cookbook.py
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from sqlalchemy import create_engine, text
from tinker_testlib import tinker_stack

pytestmark = pytest.mark.slow  # minutes of processes

pytest.importorskip("tinker_cookbook")
FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"


@pytest.fixture(scope="module")
def database_url(isolated_urls):
    """This module's own database (its trainer takes leases on tinker runs only) and the session's Redis database
    flushed (no stream holds an earlier module's entries: the fuzz suite leaves junk on `weights`)."""
    return isolated_urls[1]


@pytest.fixture(scope="module")
def stack(database_url, redis_url, tmp_path_factory):
    data_dir = tmp_path_factory.mktemp("tinker-cookbook")
    # the cookbook loads the tokenizer by the model's name: the base model is offered under its path
    with tinker_stack(database_url, redis_url, data_dir,
                      TINKER_BASE_MODELS=str(data_dir / "models" / "tiny-qwen2")) as live:
        yield live


def run(stack, args: list[str], log: Path, timeout_s: int = 600) -> None:
    env = {**os.environ, "TINKER_API_KEY": "tml-" + stack.token}
    with open(log, "w") as out:
        proc = subprocess.run([sys.executable, *args], env=env, stdout=out, stderr=subprocess.STDOUT,
                              timeout=timeout_s, check=False)
    assert proc.returncode == 0, log.read_text()[-4000:]


def metrics(log_path: Path) -> list[dict]:
    return [json.loads(line) for line in (log_path / "metrics.jsonl").read_text().splitlines() if line.strip()]


def test_the_cookbook_supervised_loop_learns_and_saves_checkpoints(stack, tmp_path):
    conversations = tmp_path / "arithmetic.jsonl"
    with open(conversations, "w") as f:
        for a in range(8):
            f.write(json.dumps({"messages": [{"role": "user", "content": f"{a} + 1 ="},
                                             {"role": "assistant", "content": str(a + 1)}]}) + "\n")
    log_path = tmp_path / "sl"
    run(stack, [str(FIXTURES / "tinker_cookbook_sft.py"), stack.url, str(stack.model_dir), str(conversations),
                str(log_path), "8"], tmp_path / "sl.log")
    rows = metrics(log_path)
    nll = [r["train_mean_nll"] for r in rows if "train_mean_nll" in r]
    assert len(nll) == 8 and nll[-1] < nll[0], nll
    saved = [json.loads(line) for line in (log_path / "checkpoints.jsonl").read_text().splitlines()]
    assert saved and all(c.get("state_path", "").startswith("tinker://") for c in saved if "state_path" in c)


def test_the_cookbook_math_rl_recipe_runs_on_arithmetic(stack, tmp_path):
    log_path = tmp_path / "rl"
    run(stack, math_rl(stack, log_path, "max_steps=3", "groups_per_batch=4", "loss_fn=importance_sampling"),
        tmp_path / "rl.log")
    rows = metrics(log_path)
    assert len([r for r in rows if "env/all/reward/total" in r]) >= 3, rows[-1:]
    # every rollout the recipe sampled is a stored trajectory
    engine = create_engine(stack.database_url)
    with engine.connect() as c:
        stored = c.execute(text("SELECT count(*) FROM episodes e JOIN runs r ON r.id = e.run_id "
                                "WHERE r.kind = 'tinker' AND e.info->>'tinker' = 'true'")).scalar()
    engine.dispose()
    assert stored >= 3 * 4 * 4


def test_the_cookbook_math_rl_recipes_async_loop_trains_with_its_default_loss(stack, tmp_path):
    """`max_steps_off_policy`: rollouts go on sampling from the sampler weights of earlier steps while the trainer
    moves on, and each step trains on groups sampled by older and newer weights, with the recipe's default loss
    (`stable_reinforce`: its datums' provenance names the samples, trained against their recorded logprobs)."""
    log_path = tmp_path / "rl-async"
    run(stack, math_rl(stack, log_path, "max_steps=4", "groups_per_batch=2", "max_steps_off_policy=1"),
        tmp_path / "rl-async.log")
    rows = [r for r in metrics(log_path) if "env/all/reward/total" in r]
    assert len(rows) >= 4, rows[-1:]
    assert max(r["sampling_client/step_max"] for r in rows) >= 1  # samplers of later steps' weights were used
    assert max(r["async/staleness_max"] for r in rows) >= 1  # and groups of earlier ones trained on later


def math_rl(stack, log_path: Path, *args: str) -> list[str]:
    return ["-m", "tinker_cookbook.recipes.math_rl.train", f"model_name={stack.model_dir}", "renderer_name=role_colon",
            f"base_url={stack.url}", "env=arithmetic", "group_size=4", "max_tokens=3",
            "learning_rate=1e-3", "lora_rank=8", "eval_every=0", "save_every=0", f"log_path={log_path}",
            "behavior_if_log_dir_exists=delete", *args]
