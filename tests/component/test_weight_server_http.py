"""The weight server as a real process over HTTP: atomic publish, checksum rejection, download, retention,
restart. Talks to it only over the wire (and reads Postgres/Redis to check what it recorded)."""

from __future__ import annotations

import hashlib
import os
import threading
import time
import uuid
from pathlib import Path

import httpx
import pytest
import redis
from sqlalchemy import create_engine, select
from trainer_testlib import WeightServer

from shared.contracts.db.models import Checkpoint, Run
from shared.contracts.messages import WeightsPublished, decode
from shared.contracts.streams import WEIGHTS
from shared.weights.fetch import fetch_checkpoint
from shared.weights.manifest import MANIFEST, verify_folder


@pytest.fixture
def run_id(database_url) -> str:
    engine = create_engine(database_url)
    rid = uuid.uuid4()
    with engine.begin() as c:
        c.execute(Run.__table__.insert().values(id=rid, name="ws-test", kind="train", status="running",
                                                config={}, policy_version=0, summary={}))
    engine.dispose()
    return str(rid)


@pytest.fixture
def server(redis_url, database_url, tmp_path):
    redis.Redis.from_url(redis_url).delete(WEIGHTS)
    ws = WeightServer(redis_url, database_url, tmp_path / "weights").start()
    yield ws
    ws.stop()


def _files(n: int = 2, size: int = 300_000) -> dict[str, bytes]:
    files = {f"model-{i}.safetensors": os.urandom(size) for i in range(n)}
    files["config.json"] = b'{"model_type": "qwen2"}'
    return files


def _upload(url: str, run_id: str, version: int, files: dict[str, bytes], wrong: str | None = None) -> list[int]:
    codes = []
    for name, data in files.items():
        digest = "0" * 64 if name == wrong else hashlib.sha256(data).hexdigest()
        r = httpx.put(f"{url}/v1/runs/{run_id}/versions/{version}/files/{name}", params={"sha256": digest},
                      content=iter([data[i:i + 65536] for i in range(0, len(data), 65536)]), timeout=30)
        codes.append(r.status_code)
    return codes


def _publish(url: str, run_id: str, version: int, files: dict[str, bytes], **extra) -> httpx.Response:
    body = {"files": {n: hashlib.sha256(d).hexdigest() for n, d in files.items()}, **extra}
    return httpx.post(f"{url}/v1/runs/{run_id}/versions/{version}/publish", json=body, timeout=60)


def _announced(redis_url: str) -> list[WeightsPublished]:
    return [decode(f) for _, f in redis.Redis.from_url(redis_url).xrange(WEIGHTS)]


def test_upload_publish_download_roundtrip(server, run_id, redis_url, database_url, tmp_path):
    files = _files()
    assert _upload(server.url, run_id, 1, files) == [200] * len(files)
    r = _publish(server.url, run_id, 1, files, metrics={"reward_mean": 0.5})
    assert r.status_code == 200, r.text
    msg = WeightsPublished.model_validate(r.json())
    assert msg.version == 1 and msg.bytes == sum(len(d) for d in files.values())

    announced = _announced(redis_url)
    assert [m.version for m in announced] == [1] and announced[0].sha256 == msg.sha256
    with create_engine(database_url).connect() as c:
        row = c.execute(select(Checkpoint).where(Checkpoint.run_id == uuid.UUID(run_id))).one()
    assert row.sha256 == msg.sha256 and row.metrics == {"reward_mean": 0.5}

    remote = msg.model_copy(update={"path": None})  # force the HTTP download path
    local = fetch_checkpoint(remote, tmp_path / "cache")
    verify_folder(local, msg.sha256, full=True)
    assert {p.name for p in local.iterdir()} == {*files, MANIFEST}
    assert (local / "model-0.safetensors").read_bytes() == files["model-0.safetensors"]
    # a download resumes where it broke off (Range), and the manifest hashes each 1 MiB piece for relays
    data = files["model-0.safetensors"]
    r = httpx.get(f"{msg.uri}/model-0.safetensors", headers={"Range": "bytes=1000-"})
    assert r.status_code == 206 and r.content == data[1000:]
    entry = verify_folder(local, msg.sha256).files["model-0.safetensors"]
    assert entry.pieces == [hashlib.sha256(data[i:i + entry.piece_bytes]).hexdigest()
                            for i in range(0, len(data), entry.piece_bytes)]


def test_processes_sharing_a_cache_fetch_one_version_at_once(server, run_id, redis_url, tmp_path):
    """Rollout workers on one host may share a checkpoint cache: several downloading the same version at once
    all get the verified folder (the first to finish puts it in place; the others keep it, not fail)."""
    from concurrent.futures import ThreadPoolExecutor
    from threading import Barrier

    files = _files(2, 200_000)
    assert _upload(server.url, run_id, 1, files) == [200] * len(files)
    r = _publish(server.url, run_id, 1, files)
    assert r.status_code == 200, r.text
    msg = WeightsPublished.model_validate(r.json()).model_copy(update={"path": None})  # over HTTP
    for attempt in range(3):
        cache, barrier = tmp_path / f"shared-cache-{attempt}", Barrier(6)

        def fetch(_: int, cache: Path = cache, barrier: Barrier = barrier) -> Path:
            barrier.wait()
            return fetch_checkpoint(msg, cache)
        with ThreadPoolExecutor(6) as pool:
            folders = list(pool.map(fetch, range(6)))
        assert len(set(folders)) == 1
        verify_folder(folders[0], msg.sha256, full=True)
        assert sorted(p.name for p in folders[0].parent.iterdir()) == ["v1"]  # no download left behind


def test_checksum_mismatch_on_upload_is_rejected_and_nothing_is_announced(server, run_id, redis_url):
    files = _files()
    codes = _upload(server.url, run_id, 1, files, wrong="model-1.safetensors")
    assert codes == [200, 422, 200]
    r = _publish(server.url, run_id, 1, files)
    assert r.status_code == 422 and "model-1.safetensors" in r.json()["detail"]
    assert _announced(redis_url) == []
    assert httpx.get(f"{server.url}/v1/runs/{run_id}/versions").json() == []


def test_verifying_server_rejects_staging_publish_with_wrong_declared_sha(run_id, redis_url, database_url, tmp_path):
    redis.Redis.from_url(redis_url).delete(WEIGHTS)
    ws = WeightServer(redis_url, database_url, tmp_path / "weights", VERIFY_STAGING="true").start()
    try:
        staging = tmp_path / "weights" / "staging-1"
        staging.mkdir(parents=True)
        files = _files(1)
        for name, data in files.items():
            (staging / name).write_bytes(data)
        bad = {"files": {n: "f" * 64 for n in files}, "staging_path": str(staging)}
        r = httpx.post(f"{ws.url}/v1/runs/{run_id}/versions/1/publish", json=bad, timeout=30)
        assert r.status_code == 422 and "sha256" in r.json()["detail"]
        assert _announced(redis_url) == []
        assert not (tmp_path / "weights" / run_id / "v1").exists()
    finally:
        ws.stop()


def test_staging_publish_retention_and_restart(server, run_id, redis_url, tmp_path):
    rewards = {1: 0.9, 2: 0.1, 3: 0.2, 4: 0.3}
    for v, reward in rewards.items():
        staging = tmp_path / "weights" / f"staging-{v}"
        staging.mkdir(parents=True)
        files = _files(1, 1000)
        for name, data in files.items():
            (staging / name).write_bytes(data)
        r = _publish(server.url, run_id, v, files, staging_path=str(staging), metrics={"reward_mean": reward},
                     best_metric="reward_mean")
        assert r.status_code == 200, r.text
        assert not staging.exists()  # moved, not copied
    # retention runs after the publish request, on the server's retention thread
    deadline = time.monotonic() + 30
    while (kept := [v["version"] for v in httpx.get(f"{server.url}/v1/runs/{run_id}/versions").json()]) != [1, 3, 4]:
        assert time.monotonic() < deadline, f"retention left {kept}"
        time.sleep(0.05)
    assert kept == [1, 3, 4]  # last two plus the best (v1)
    while (tmp_path / "weights" / run_id / "v2").exists():
        assert time.monotonic() < deadline, "v2's folder was not removed"
        time.sleep(0.05)

    # A crash after the rename but before the row: the folder is registered and announced on restart.
    server.stop()
    orphan = tmp_path / "weights" / run_id / "v7"
    orphan.mkdir()
    (orphan / "config.json").write_bytes(b"{}")
    from shared.weights.manifest import write_manifest
    write_manifest(orphan, run_id, 7)
    (tmp_path / "weights" / run_id / ".tmp-v8-deadbeef").mkdir()
    server.start()
    kept = [v["version"] for v in httpx.get(f"{server.url}/v1/runs/{run_id}/versions").json()]
    assert kept == [1, 3, 4, 7]
    assert 7 in [m.version for m in _announced(redis_url)]
    assert not (tmp_path / "weights" / run_id / ".tmp-v8-deadbeef").exists()
    r = httpx.get(f"{server.url}/v1/runs/{run_id}/versions/4/{MANIFEST}")
    assert r.status_code == 200 and r.json()["version"] == 4


def test_a_pinned_version_outlives_retention_until_unpinned(server, run_id, database_url, tmp_path):
    """A pinned version (a named Tinker sampler checkpoint) is kept however many newer versions come; once
    unpinned, the pass that DELETE .../pin runs removes it, files and all, and says so."""
    def versions() -> list[int]:
        return [v["version"] for v in httpx.get(f"{server.url}/v1/runs/{run_id}/versions").json()]

    for v in range(1, 6):
        files = _files(1, 1000)
        assert _upload(server.url, run_id, v, files) == [200] * len(files)
        assert _publish(server.url, run_id, v, files, pinned=v == 1).status_code == 200
    deadline = time.monotonic() + 30
    while (kept := versions()) != [1, 4, 5]:  # the newest two and the pinned one
        assert time.monotonic() < deadline, f"retention left {kept}"
        time.sleep(0.05)
    with create_engine(database_url).connect() as c:
        pins = dict(c.execute(select(Checkpoint.version, Checkpoint.pinned).where(
            Checkpoint.run_id == uuid.UUID(run_id))).all())
    assert pins == {v: v == 1 for v in range(1, 6)}

    r = httpx.delete(f"{server.url}/v1/runs/{run_id}/versions/1/pin", timeout=30)
    assert r.status_code == 200 and r.json() == {"deleted": [1]}
    assert versions() == [4, 5] and not (tmp_path / "weights" / run_id / "v1").exists()
    again = httpx.delete(f"{server.url}/v1/runs/{run_id}/versions/1/pin", timeout=30)  # idempotent
    assert again.status_code == 200 and again.json() == {"deleted": []}


def test_trusting_server_records_declared_hashes_and_hashes_undeclared_files(redis_url, database_url, run_id,
                                                                              tmp_path):
    ws = WeightServer(redis_url, database_url, tmp_path / "weights").start()  # the default trusts declared hashes
    try:
        for version, declare in ((1, True), (2, False)):
            staging = tmp_path / "weights" / f"staging-{version}"
            staging.mkdir(parents=True)
            files = _files(1, 5000)
            for name, data in files.items():
                (staging / name).write_bytes(data)
            body = {"staging_path": str(staging),
                    "files": {n: hashlib.sha256(d).hexdigest() if declare else "" for n, d in files.items()}}
            r = httpx.post(f"{ws.url}/v1/runs/{run_id}/versions/{version}/publish", json=body, timeout=30)
            assert r.status_code == 200, r.text
            msg = WeightsPublished.model_validate(r.json())
            verify_folder(Path(msg.path), msg.sha256, full=True)  # the manifest matches the bytes either way
    finally:
        ws.stop()


def test_publish_does_not_wait_for_retention(database_url, redis_url, run_id, tmp_path):
    """The publish call returns while the retention pass it asked for is still running (held here until the
    test lets it go); the pass then deletes what is no longer kept."""
    from services.weight_server.store import CheckpointStore

    store = CheckpointStore(tmp_path / "weights", create_engine(database_url), redis.Redis.from_url(redis_url),
                            "http://127.0.0.1:1", keep_last=1)
    release, passes = threading.Event(), []
    apply = store.apply_retention

    def held_retention(run, best):
        assert release.wait(30)
        passes.append(apply(run, best))
        return passes[-1]

    store.apply_retention = held_retention
    try:
        for v in (1, 2):
            staging = tmp_path / "weights" / f"staging-{v}"
            staging.mkdir(parents=True)
            (staging / "config.json").write_bytes(b"{}")
            store.publish(run_id, v, {"config.json": ""}, {}, staging_path=str(staging))
        assert (tmp_path / "weights" / run_id / "v1").is_dir() and passes == []  # both publishes returned
        release.set()
    finally:
        store.close()
    assert passes == [[1], []] and not (tmp_path / "weights" / run_id / "v1").exists()


def test_an_export_is_whole_or_absent_apart_from_the_runs_versions(server, run_id, redis_url, tmp_path):
    """Exports (a Tinker model's save_weights_external): uploaded file by file against their sha256, readable only
    once committed, replaced whole by a later commit, deleted with their files; never a version of the run."""
    base = f"{server.url}/v1/exports/{run_id}/final"

    def put(name: str, data: bytes, sha: str | None = None) -> int:
        return httpx.put(f"{base}/files/{name}", params={"sha256": sha or hashlib.sha256(data).hexdigest()},
                         content=data, timeout=30).status_code

    first = {"adapter_config.json": b'{"r": 8}', "adapter_model.safetensors": os.urandom(200_000)}
    assert [put(n, d) for n, d in first.items()] == [200, 200]
    assert httpx.get(f"{base}/files/adapter_config.json").status_code == 404  # not committed: not there
    refused = httpx.post(f"{base}/commit", json={"files": [*first, "missing.bin"]})
    assert refused.status_code == 422 and "upload each file first" in refused.text
    done = httpx.post(f"{base}/commit", json={"files": list(first)})
    assert done.status_code == 200 and done.json()["files"] == {n: len(d) for n, d in first.items()}
    assert {n: httpx.get(f"{base}/files/{n}").content for n in first} == first

    assert put("adapter_model.safetensors", b"x", sha="0" * 64) == 422  # a corrupt upload is refused
    assert put("adapter_model.safetensors.age", b"sealed") == 200
    assert httpx.post(f"{base}/commit", json={"files": ["adapter_model.safetensors.age"]}).status_code == 200
    assert httpx.get(f"{base}/files/adapter_model.safetensors.age").content == b"sealed"
    assert httpx.get(f"{base}/files/adapter_model.safetensors").status_code == 404  # replaced whole
    assert httpx.get(f"{server.url}/v1/runs/{run_id}/versions").json() == [] and _announced(redis_url) == []

    for bad in (f"{server.url}/v1/exports/not-a-run/final/files/x", f"{server.url}/v1/exports/{run_id}/.hidden/files/x",
                f"{base}/files/..%2Fescape"):
        assert httpx.put(bad, content=b"x").status_code in (404, 422), bad
    assert httpx.delete(base).status_code == 204
    assert httpx.get(f"{base}/files/adapter_model.safetensors.age").status_code == 404
    assert not (tmp_path / "weights" / "exports" / run_id / "final").exists()
