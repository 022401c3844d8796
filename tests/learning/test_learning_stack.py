"""The learning loop across real services (weight server, env worker, rollout worker with hot reload,
trainer, controller, API) on private Redis/Postgres databases: the tiny model learns the recall task (its
answer depends on the prompt) through versions the rollout worker actually served, judged per question
from the stored trajectories (read back through the API's SQL endpoint) by the demo's own bar."""

from __future__ import annotations

import pytest

from tests.support.demo import judge, run_stack


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_every_question_is_learned_through_hot_reloaded_versions(tmp_path, isolated_urls):
    redis_url, database_url = isolated_urls  # no earlier module's runs competing for the trainer
    result = run_stack(tmp_path, timeout_s=840, env={"REDIS_URL": redis_url, "DATABASE_URL": database_url},
                       log=lambda *_: None)
    failures = judge(result | {"wall_s": 0})  # the 10-minute bar is the demo's, on a quiet machine
    assert not failures, (failures, result["reward_by_version"])
