"""Each fault-injection scenario of tests/support/chaos.py as a test: the run completes, nothing lost, nothing doubled.

Every scenario brings up its own system (restartable Redis and PostgreSQL, the services, the mock LLM), so
these tests need no fixtures; `make chaos` runs the same scenarios and writes bench/results/chaos.json.
"""

from __future__ import annotations

import pytest

from tests.support.chaos import SCENARIOS, run_scenario

pytestmark = pytest.mark.chaos


@pytest.mark.timeout(600)
@pytest.mark.parametrize("scenario", SCENARIOS, ids=[s.name for s in SCENARIOS])
def test_scenario_completes_with_nothing_lost_or_doubled(scenario):
    result = run_scenario(scenario, tasks=40, samples=2)
    assert result.get("completed"), result
    if scenario.kind == "train":  # every version trained, each sample used at most once (train_samples' key)
        assert result["versions_trained"] >= 6 and 0 < result["trained_samples"] <= result["stored"], result
        assert result["trained_twice"] == 0, result
    else:
        assert result["dispatched"] == 80, result
    assert result["lost"] == 0 and result["duplicates"] == 0, result
    assert result["stored"] + result["failed_recorded"] == result["dispatched"], result
    assert result["recovery_s"] is not None, result
    if scenario.kind == "train" and "outage" in scenario.name:  # the trainer rode the outage out, not restarted
        assert result["exited"] == [], result
