"""The learning loop across real services (weight server, env worker, rollout worker with hot reload,
trainer, controller, API) on private Redis/Postgres databases: the tiny model's reward climbs through
versions the rollout worker actually served."""

from __future__ import annotations

import pytest

from bench.demo import run_stack


@pytest.mark.slow
def test_reward_climbs_through_hot_reloaded_versions(tmp_path, isolated_urls):
    redis_url, database_url = isolated_urls  # no earlier module's runs competing for the trainer
    result = run_stack(tmp_path, steps=10, tasks=8, n=8, lr=1e-2, max_staleness=1, timeout_s=300,
                       env={"REDIS_URL": redis_url, "DATABASE_URL": database_url}, log=lambda *_: None)
    rewards = result["reward_by_version"]
    assert result["initial_reward"] <= 0.35, rewards
    assert result["final_reward"] >= 0.7, rewards
    assert result["versions_used_by_rollouts"] >= 5, rewards  # rollouts ran on hot-reloaded versions
    assert result["versions_published"] >= 10
