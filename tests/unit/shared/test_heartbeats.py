"""shared/platform/heartbeats.py reads every service's heartbeat: a field the model types must not collide with a status
entry some service writes in another shape (a rollout worker's `runs` is a count, a controller's a dict of
dispatch states), or that service's processes would be skipped as unreadable, i.e. counted as dead."""

from __future__ import annotations

import json

from shared.platform.heartbeats import parse_heartbeats

BEATS = {
    "rollout-worker": {"service": "rollout-worker", "worker_id": "w", "port": 1, "engines": ["hf"],
                       "max_concurrency": 4, "inflight": 1, "runs": 3, "gateway_url": "http://w:1"},
    "controller": {"service": "controller", "worker_id": "c", "port": 2,
                   "runs": {"r1": {"status": "running", "in_flight": 2, "completed": 5, "policy_version": 1}}},
    "trainer": {"service": "trainer", "worker_id": "t", "port": 3, "runs": {"r1": 4}, "trains": ["r1"],
                "broken": {}, "model_copies": 1},
    "env-worker": {"service": "env-worker", "worker_id": "e", "port": 4, "sessions": 0},
}


def test_every_services_heartbeat_parses_with_what_its_readers_need():
    beats = {b.service: b for b in parse_heartbeats([json.dumps(v).encode() for v in BEATS.values()])}
    assert set(beats) == set(BEATS)
    assert (beats["rollout-worker"].max_concurrency, beats["rollout-worker"].engines) == (4, ["hf"])
    assert beats["trainer"].trains == ["r1"] and beats["controller"].trains == []
    assert beats["rollout-worker"].runs == 3  # status entries the model does not name are kept as they are


def test_an_unreadable_heartbeat_is_skipped_not_fatal():
    assert parse_heartbeats([b"not json", None, json.dumps({"max_concurrency": "many"}).encode(),
                             json.dumps(BEATS["env-worker"]).encode()])[0].worker_id == "e"
