"""Weight sync by deltas, end to end: the trainer's publisher -> a real weight-server process (HTTP uploads and
downloads, Postgres rows, announcements on real Redis) -> rollout workers' reload path (RunRegistry + HF engine)
over 24 versions. After every version, each worker serves weights bit-identical to the trainer's export of the
version it reports: one worker follows every announcement (deltas applied in place), one sees only every third
(behind: rebuilt from the nearest snapshot), one has its weights tampered with (its delta fails to verify: full
weights instead), one joins late; one delta is corrupted on the server's disk and the server is restarted."""

from __future__ import annotations

import shutil
import uuid
from pathlib import Path

import pytest
import redis
import torch
from fixtures.rollout_stack import insert_run, run_config
from safetensors.torch import load_file, save_file
from sqlalchemy import create_engine
from trainer_testlib import WeightServer

from services.rollout_worker.run_engines import RunRegistry
from services.trainer.publisher import WeightPublisher
from shared.contracts.messages import decode
from shared.contracts.streams import WEIGHTS
from shared.weights.manifest import DELTA_FILE, MANIFEST, CheckpointManifest, tensor_entries
from tests.support.tiny_model import build_tiny_model

VERSIONS = 24
SNAPSHOT_EVERY = 5  # snapshots at 1, 6, 11, 16, 21
CORRUPT = 8  # a delta: workers must not serve 8, 9, 10 (built on it) and come back at the snapshot 11
RESTART_AFTER = 15


class Trainer:
    """Stands in for the trainer's export: each step changes ~2% of the elements of every tensor (on even
    versions the norms' tensors stay as they were: their digests are carried over from the version before)."""

    def __init__(self, model: Path, staging: Path):
        self.model, self.staging = model, staging
        self.state = load_file(str(model / "model.safetensors"))
        self.gen = torch.Generator().manual_seed(0)
        self.exports = {0: {k: v.clone() for k, v in self.state.items()}}  # version 0: the base model

    def step_and_export(self, version: int) -> Path:
        for name, t in self.state.items():
            if version % 2 == 0 and "norm" in name:
                continue
            mask = torch.rand(t.shape, generator=self.gen) < 0.02
            t[mask] += 1e-3 * torch.randn(int(mask.sum()), generator=self.gen)
        folder = self.staging / f"v{version}"
        folder.mkdir(parents=True)
        for p in self.model.iterdir():
            if p.is_file() and p.suffix != ".safetensors":
                shutil.copyfile(p, folder / p.name)
        save_file(self.state, str(folder / "model.safetensors"), metadata={"format": "pt"})
        self.exports[version] = {k: v.clone() for k, v in self.state.items()}
        return folder


def served_matches(engine, export: dict[str, torch.Tensor]) -> bool:
    params = engine.model.state_dict()
    return all(torch.equal(params[n].view(torch.int32), t.view(torch.int32)) for n, t in export.items())


@pytest.fixture
def model(tmp_path) -> Path:
    return build_tiny_model(tmp_path / "model", seed=0)


async def test_deltas_keep_every_worker_bit_exact(redis_url, database_url, model, tmp_path):
    redis.Redis.from_url(redis_url).delete(WEIGHTS)
    weights_dir = tmp_path / "weights"
    server = WeightServer(redis_url, database_url, weights_dir, keep_last=3, ANNOUNCE_PATH="false",
                          SNAPSHOT_EVERY=str(SNAPSHOT_EVERY)).start()
    run_id = insert_run(database_url, run_config(str(model)))
    db = create_engine(database_url)
    workers = {name: RunRegistry(db, tmp_path / f"cache-{name}", 1.0)
               for name in ("every", "behind", "tampered", "late")}
    ctx = {name: await workers[name].get(run_id) for name in ("every", "behind", "tampered")}
    trainer, publisher = Trainer(model, tmp_path / "staging"), WeightPublisher(server.url, None, timeout_s=60)
    stream = redis.Redis.from_url(redis_url)
    last_id, kinds = "0-0", {}
    try:
        for v in range(1, VERSIONS + 1):
            msg = publisher.publish(run_id, v, trainer.step_and_export(v), {})
            kinds[v] = publisher.last_kind
            stored = CheckpointManifest.model_validate_json((weights_dir / run_id / f"v{v}" / MANIFEST).read_bytes())
            assert stored.tensors == tensor_entries(trainer.exports[v])  # hashed or carried over: the export's
            if v == CORRUPT:  # one flipped byte in the stored delta: its file hash no longer matches
                path = weights_dir / run_id / f"v{v}" / DELTA_FILE
                data = bytearray(path.read_bytes())
                data[len(data) // 2] ^= 0xFF
                path.write_bytes(bytes(data))
            entries = stream.xrange(WEIGHTS, f"({last_id}", "+")
            last_id = entries[-1][0].decode()
            announced = [decode(f) for _, f in entries]
            assert [m.version for m in announced] == [v] and announced[0].sha256 == msg.sha256
            await workers["every"].on_weights(announced[0])
            if v % 3 == 0:
                await workers["behind"].on_weights(announced[0])
            await workers["tampered"].on_weights(announced[0])
            if v == 3:  # the worker's weights are no longer v3's: the delta to v4 cannot verify
                with torch.no_grad():
                    next(iter(ctx["tampered"].engine.model.parameters())).view(-1)[0] += 1.0
            if v == 13:  # joins late: starts from the newest version (rebuilt from snapshot 11 + deltas 12, 13)
                ctx["late"] = await workers["late"].get(run_id)
                assert ctx["late"].engine.version == 13
            elif v > 13:
                await workers["late"].on_weights(announced[0])
            if v == RESTART_AFTER:
                server.stop()
                server.start()

            unusable = CORRUPT <= v < 11
            assert ctx["every"].engine.version == (CORRUPT - 1 if unusable else v)
            for name, c in ctx.items():
                if name == "tampered" and c.engine.version == 3:
                    continue  # serves tampered v3 until the next version comes (verified below)
                assert served_matches(c.engine, trainer.exports[c.engine.version]), (name, v, c.engine.version)
            assert ctx["tampered"].engine.version == ctx["every"].engine.version

        assert all(c.engine.version == VERSIONS for c in ctx.values())
        assert [v for v, k in kinds.items() if k == "full"] == [1, 6, 11, 16, 21]
        # the worker that saw every version applied every usable delta in place: it never rebuilt full weights
        assert not list((tmp_path / "cache-every").rglob("*.full"))
        assert (tmp_path / "cache-tampered" / run_id / "v4.full").is_dir()  # its v4 was rebuilt, not patched
        # what is kept: the last 3 versions and the chain they are built on (snapshot 21 and deltas since)
        kept = sorted(int(p.name[1:]) for p in (weights_dir / run_id).glob("v*"))
        assert kept == [21, 22, 23, 24]
        manifests = {v: CheckpointManifest.model_validate_json((weights_dir / run_id / f"v{v}" / MANIFEST)
                                                               .read_bytes()) for v in kept}
        assert manifests[22].kind == "delta" and manifests[22].base_version == 21
        assert manifests[22].files[DELTA_FILE].bytes < manifests[21].full_bytes / 4
    finally:
        server.stop()
        for w in workers.values():
            await w.close()
        db.dispose()


async def test_publish_of_a_delta_on_a_missing_base_is_refused(redis_url, database_url, model, tmp_path):
    server = WeightServer(redis_url, database_url, tmp_path / "weights").start()
    try:
        import httpx

        run_id = str(uuid.uuid4())
        plan = httpx.get(f"{server.url}/v1/runs/{run_id}/versions/1/plan").json()
        assert plan == {"base_version": None, "base_sha256": None}
        r = httpx.post(f"{server.url}/v1/runs/{run_id}/versions/2/publish",
                       json={"files": {}, "kind": "delta", "base_version": 1, "tensors": {}})
        assert r.status_code == 422 and "does not hold" in r.text
    finally:
        server.stop()

