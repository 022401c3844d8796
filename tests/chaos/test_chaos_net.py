"""Each network fault of tests/support/chaos_net.py as a test: the services on hosts of their own (network
namespaces), a link cut for 30 s; the run completes with nothing lost or doubled, and the fault was real (the
run's progress or its stall reason shows it). `make chaos-net` runs the same and writes bench/results/chaos.json.
"""

from __future__ import annotations

import os
import shutil

import pytest

from tests.support.chaos_net import NET_SCENARIOS, run_net_scenario

pytestmark = [pytest.mark.chaos, pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("socat"),
                                                    reason="network namespaces and tc need root; socat forwards")]
LOSSY = pytest.mark.skipif(not shutil.which("nft"), reason="random packet loss needs nftables (make chaos-deps)")
BY_NAME = {s.name: s for s in NET_SCENARIOS}


def run(name: str) -> dict:
    result = run_net_scenario(BY_NAME[name], tasks=40, samples=2)
    assert result.get("completed"), result
    if BY_NAME[name].kind == "train":  # every version trained on one batch of 4 groups x 4 samples, none twice
        assert result["versions_trained"] >= 6 and result["trained_samples"] == 16 * result["versions_trained"], result
        assert result["trained_twice"] == 0, result
    else:
        assert result["dispatched"] == 80 and result["stored"] == 80, result
    assert result["lost"] == 0 and result["duplicates"] == 0, result
    assert result["recovery_s"] is not None, result
    assert result["exited"] == [], result  # no service died of the fault (none is restarted here)
    return result


@pytest.mark.timeout(600)
def test_rollout_host_cut_off_from_redis():
    result = run("rollout_redis_partition_30s")
    assert any(r.startswith("no live rollout worker") for r in result["stall_reasons_during_fault"]), result


@pytest.mark.timeout(600)
def test_controller_cut_off_from_postgres():
    result = run("controller_postgres_partition_30s")
    start, end = result["progress_at_fault_start_end"]
    assert start == end, result  # nothing stored while the controller could not reach Postgres: the cut was real
    assert any("controller" in o and "cannot reach PostgreSQL" in o for o in result["outages_during_fault"]), result


@pytest.mark.timeout(600)
def test_api_cut_off_from_redis_while_runs_are_started_and_paused():
    result = run("api_redis_partition_30s")
    calls = {c["call"]: c for c in result["side_run_calls"]}
    for during in ("start during the partition", "pause during the partition"):
        assert calls[during]["status"] == 503 and "Redis is unreachable" in calls[during]["said"], result
    assert calls["start after it"]["status"] == 201 and calls["stop after it"]["status"] == 200, result


@pytest.mark.timeout(600)
def test_trainer_cut_off_from_postgres_lets_its_runs_go_and_resumes_them_without_a_restart():
    result = run("trainer_postgres_partition_30s")
    start, end = result["progress_at_fault_start_end"]
    assert start == end, result  # no version recorded while the trainer could not reach Postgres
    assert any("trainer" in o and "cannot reach PostgreSQL" in o for o in result["outages_during_fault"]), result


@pytest.mark.timeout(600)
def test_weight_server_link_down_while_a_checkpoint_crosses_it():
    result = run("weight_transfer_cut_5s")
    assert result["weight_reloads"].get("ok", 0) > 0, result


@LOSSY
@pytest.mark.timeout(900)
def test_a_whole_training_run_over_slow_lossy_weight_server_links():
    """200 ms each way and 10% of packets lost each way on every weight-server link, from the start: every version
    is uploaded, fetched and served all the same (run() checks nothing lost or trained twice)."""
    result = run("weight_links_200ms_10pct_loss")
    assert result["weight_reloads"].get("ok", 0) >= result["versions_trained"] - 1, result
    link = result["weight_link"]  # the fault was real: packets dropped, and a round trip takes the delay twice
    assert link["packets_dropped"] > 0 and link["healthz_round_trip_s"] >= 0.4, result
