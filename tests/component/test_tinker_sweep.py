"""The trainer's sweep of expired Tinker checkpoints against real Redis: an expired checkpoint's folder under the
trainer's STATE_DIR goes, then its record; a live one stays; a folder under another STATE_DIR is left, record and
all, to the trainer that wrote it; storage a live copy shares (a folder, an export, a pinned sampler version) is kept
until the last record sharing it expires; Redis out of reach skips the sweep instead of failing the trainer's loop."""

from __future__ import annotations

import time
import uuid
from types import SimpleNamespace

from services.trainer.tinker_models import TinkerModels
from shared.contracts.messages import TinkerCheckpoint
from shared.contracts.streams import tinker_key
from shared.contracts.tinker_run import checkpoint_path
from shared.platform.bus import Redis


def sweeper(redis, state_dir) -> TinkerModels:
    models = object.__new__(TinkerModels)  # the sweep reads only the trainer's Redis and STATE_DIR
    models.trainer = SimpleNamespace(redis=redis, settings=SimpleNamespace(state_dir=state_dir))
    return models


async def test_expired_checkpoints_are_removed_and_the_rest_left(redis_url, tmp_path):
    redis = Redis.from_url(redis_url)
    model, now = f"s{uuid.uuid4().hex[:8]}:train:0", time.time()
    mine, elsewhere = tmp_path / "state", tmp_path / "other-trainer"

    def saved(name: str, root, expires_at) -> tuple:
        folder = root / "tinker" / "run" / name
        folder.mkdir(parents=True)
        record = TinkerCheckpoint(owner="o", model_id=model, run_id="run", kind="weights", name=name, base_model="b",
                                  lora={"rank": 2}, seq_id=1, folder=str(folder), created_at=now,
                                  expires_at=expires_at)
        key = tinker_key("checkpoint", checkpoint_path(model, "weights", name))
        return key, folder, record

    cases = {"expired": saved("expired", mine, now - 1), "live": saved("live", mine, now + 3600),
             "kept": saved("kept", mine, None), "theirs": saved("theirs", elsewhere, now - 1)}
    try:
        for key, _, record in cases.values():
            await redis.set(key, record.model_dump_json())
        await sweeper(redis, mine).sweep_checkpoints()
        gone = {name for name, (key, folder, _) in cases.items() if not folder.exists()}
        unrecorded = {name for name, (key, _, _) in cases.items() if not await redis.exists(key)}
        assert gone == unrecorded == {"expired"}
    finally:
        await redis.delete(*(key for key, _, _ in cases.values()))
        await redis.aclose()


async def test_storage_a_live_copy_shares_is_kept_until_the_last_record_goes(redis_url, tmp_path):
    redis = Redis.from_url(redis_url)
    state, now = tmp_path / "state", time.time()
    folder = state / "tinker" / "run" / "w"
    folder.mkdir(parents=True)
    exports, unpinned = [], []
    models = sweeper(redis, state)
    models.trainer.publisher = SimpleNamespace(delete_export=lambda run_id, name: exports.append((run_id, name)),
                                               unpin=lambda run_id, version: unpinned.append((run_id, version)))

    def record(model: str, kind: str, expires_at, **where) -> tuple[str, TinkerCheckpoint]:
        r = TinkerCheckpoint(owner="o", model_id=model, run_id="run", kind=kind, name="w", base_model="b",
                             lora={"rank": 2}, seq_id=1, created_at=now, expires_at=expires_at, **where)
        return tinker_key("checkpoint", checkpoint_path(model, kind, "w")), r

    tag = uuid.uuid4().hex[:8]
    source, copy = record(f"s{tag}:train:0", "weights", now - 1, folder=str(folder)), \
        record(f"c{tag}:train:0", "weights", now + 3600, folder=str(folder))
    export, export_copy = record(f"s{tag}:train:0", "external_weights", now - 1, files={"a": 1}), \
        record(f"c{tag}:train:0", "external_weights", None, files={"a": 1})
    sampler, sampler_copy = record(f"s{tag}:train:0", "sampler_weights", now - 1, version=7), \
        record(f"c{tag}:train:0", "sampler_weights", None, version=7)
    pairs = (source, copy, export, export_copy, sampler, sampler_copy)
    keys = [k for k, _ in pairs]
    try:
        for key, r in pairs:
            await redis.set(key, r.model_dump_json())
        await models.sweep_checkpoints()
        # the expired sources' records go; what their live copies share stays (the sampler weights stay pinned)
        assert [bool(await redis.exists(k)) for k in keys] == [False, True] * 3
        assert folder.exists() and exports == [] and unpinned == []

        for key, r in (copy, export_copy, sampler_copy):  # the copies expire (deleted) too: now the storage goes
            await redis.set(key, r.model_copy(update={"expires_at": now - 1}).model_dump_json())
        await models.sweep_checkpoints()
        assert not any([await redis.exists(k) for k in keys])
        assert not folder.exists() and exports == [("run", "w")] and unpinned == [("run", 7)]
    finally:
        await redis.delete(*keys)
        await redis.aclose()


async def test_a_removed_checkpoints_storage_is_counted_once_as_its_owners_usage(redis_url, tmp_path):
    from shared.stores.tinker_usage import usage_key

    redis = Redis.from_url(redis_url)
    owner, model = f"o{uuid.uuid4().hex[:8]}", f"s{uuid.uuid4().hex[:8]}:train:0"
    hour = int(time.time()) // 3600 - 3
    record = TinkerCheckpoint(owner=owner, model_id=model, run_id="run", kind="sampler_weights", name="v",
                              base_model="b", lora={"rank": 2}, seq_id=1, version=1, size_bytes=1000,
                              created_at=hour * 3600 + 1800, expires_at=(hour + 1) * 3600 + 900)
    key = tinker_key("checkpoint", checkpoint_path(model, "sampler_weights", "v"))
    models, unpinned = sweeper(redis, tmp_path), []
    models.trainer.publisher = SimpleNamespace(unpin=lambda run_id, version: unpinned.append(version))
    try:
        for _ in range(2):  # removed twice (a record written back meanwhile): counted once
            await redis.set(key, record.model_dump_json())
            await models.sweep_checkpoints()
            assert not await redis.exists(key)
        assert unpinned == [1, 1]  # unpinning is idempotent on the weight server
        field = b'["storage", null, "b"]'
        assert [await redis.hget(usage_key(owner, h), field) for h in (hour, hour + 1)] == [b"1800000", b"900000"]
    finally:
        await redis.delete(key, usage_key(owner, hour), usage_key(owner, hour + 1))
        await redis.aclose()


async def test_a_sweep_with_redis_out_of_reach_is_skipped(tmp_path):
    redis = Redis.from_url("redis://127.0.0.1:1/0", socket_connect_timeout=1)  # nothing listens on port 1
    try:
        await sweeper(redis, tmp_path).sweep_checkpoints()
    finally:
        await redis.aclose()
