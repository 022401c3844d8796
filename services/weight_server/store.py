"""Versioned checkpoint storage: WEIGHTS_DIR/<run_id>/v<version>/ (files + MANIFEST.json).

A version is a full snapshot or a delta on the version before it; `plan` says which. Retention keeps each kept
version's whole chain. Publish order, each step durable before the next: temp folder, fsync and sha256 per
file, MANIFEST.json, rename into place, `checkpoints` row, then `WeightsPublished` on `weights`: a reader that
sees the announcement always finds a complete folder. A crash between rename and announcement is repaired at
start-up (`reconcile`).

More: docs/weight-sync.md#versions-on-disk
"""

from __future__ import annotations

import hashlib
import os
import shutil
import time
import uuid
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

from sqlalchemy import Engine, select, update
from sqlalchemy.dialects.postgresql import insert

from shared.contracts.db.models import Checkpoint
from shared.contracts.messages import WeightsPublished
from shared.contracts.streams import WEIGHTS
from shared.platform.bus import SyncRedis, announce
from shared.platform.logs import get_logger
from shared.weights.manifest import (
    ADAPTER_CONFIG,
    ADAPTER_WEIGHTS,
    MANIFEST,
    PIECE_BYTES,
    CheckpointManifest,
    ChecksumError,
    FileEntry,
    fsync_path,
    piece_hashes,
    read_manifest,
    sha256_file,
)

log = get_logger(__name__)


class PublishError(ValueError):
    """The publish request is wrong (missing file, bad name, checksum mismatch); the message says which."""


def check_name(name: str) -> str:
    """File names are flat (no folders): refuse anything that could escape the checkpoint folder."""
    if not name or name in (".", "..", MANIFEST) or "/" in name or "\\" in name or name.startswith("."):
        raise PublishError(f"bad file name {name!r}: use a plain file name such as model.safetensors")
    return name


class Upload:
    """One file arriving over HTTP: written and hashed chunk by chunk, checked against the declared sha256."""

    def __init__(self, path: Path):
        self.path, self.hash, self.size = path, hashlib.sha256(), 0
        self.file = open(path, "wb")  # noqa: SIM115 (closed in finish/abort)

    def write(self, chunk: bytes) -> None:
        self.hash.update(chunk)
        self.file.write(chunk)
        self.size += len(chunk)

    def finish(self, expected_sha256: str | None) -> int:
        self.file.flush()
        os.fsync(self.file.fileno())
        self.file.close()
        if expected_sha256 and self.hash.hexdigest() != expected_sha256:
            self.path.unlink()
            raise PublishError(
                f"{self.path.name}: received sha256 {self.hash.hexdigest()} but the publisher declared {expected_sha256}"
            )
        return self.size

    def abort(self) -> None:
        self.file.close()
        self.path.unlink(missing_ok=True)


class CheckpointStore:
    def __init__(self, root: Path, engine: Engine, redis_client: SyncRedis, public_url: str,
                 keep_last: int = 3, announce_path: bool = True, verify_staging: bool = False,
                 snapshot_every: int = 10):
        self.root, self.engine, self.redis = root, engine, redis_client
        self.verify_staging, self.snapshot_every = verify_staging, snapshot_every
        self.public_url, self.keep_last, self.announce_path = public_url, keep_last, announce_path
        root.mkdir(parents=True, exist_ok=True)
        self._retention = ThreadPoolExecutor(max_workers=1, thread_name_prefix="retention")

    def close(self) -> None:
        """Finish the retention passes already asked for."""
        self._retention.shutdown(wait=True)

    # -- paths ------------------------------------------------------------------------------------------------
    def folder(self, run_id: str, version: int) -> Path:
        return self.root / str(uuid.UUID(run_id)) / f"v{version}"

    def upload_dir(self, run_id: str, version: int) -> Path:
        """Where HTTP uploads of one version collect until publish."""
        path = self.root / str(uuid.UUID(run_id)) / f".upload-v{version}"
        path.mkdir(parents=True, exist_ok=True)
        return path

    def uri(self, run_id: str, version: int) -> str:
        return f"{self.public_url}/v1/runs/{run_id}/versions/{version}"

    # -- upload -----------------------------------------------------------------------------------------------
    def open_upload(self, run_id: str, version: int, name: str) -> Upload:
        return Upload(self.upload_dir(run_id, version) / check_name(name))

    # -- publish ----------------------------------------------------------------------------------------------
    def manifest(self, run_id: str, version: int) -> CheckpointManifest | None:
        """The stored manifest of an available version (None when there is none)."""
        path = self.folder(run_id, version) / MANIFEST
        return CheckpointManifest.model_validate_json(path.read_bytes()) if path.is_file() else None

    def plan(self, run_id: str, version: int) -> dict:
        """What the publisher of `version` should send: a delta on `base_version` (manifest sha256
        `base_sha256`), or a full snapshot when both are None."""
        full = {"base_version": None, "base_sha256": None}
        base = self._row(run_id, version - 1)
        manifest = self.manifest(run_id, version - 1) if base is not None else None
        if manifest is None or not manifest.tensors or len(self._chain(run_id, version - 1)) >= self.snapshot_every:
            return full
        return {"base_version": version - 1, "base_sha256": base.sha256}

    def _chain(self, run_id: str, version: int) -> list[int]:
        """`version` and the versions it is built on, back to and including its snapshot."""
        chain, manifest = [version], self.manifest(run_id, version)
        while manifest is not None and manifest.kind == "delta":
            chain.append(manifest.base_version)
            manifest = self.manifest(run_id, manifest.base_version)
        return chain

    def publish(self, run_id: str, version: int, files: dict[str, str], metrics: dict[str, float],
                staging_path: str | None = None, best_metric: str | None = None,
                layout: dict | None = None, pinned: bool = False) -> WeightsPublished:
        """Make version `version` of `run_id` durable and announce it. Idempotent for the same version.
        `layout`: the manifest's kind, base_version, tensors and full_bytes (default: a full snapshot without
        per-tensor hashes). `pinned`: retention keeps it until `unpin`."""
        existing = self._row(run_id, version)
        if existing is not None and self.folder(run_id, version).is_dir():
            if pinned and not existing.pinned:  # a retried publish that now asks for the pin
                self._set_pinned(run_id, version, True)
            return self._message(existing)
        layout = self._check_layout(run_id, version, dict(layout or {}))
        if layout.get("base_model") and not {ADAPTER_CONFIG, ADAPTER_WEIGHTS} <= set(files):
            raise PublishError(f"LoRA v{version} must hold {ADAPTER_CONFIG} and {ADAPTER_WEIGHTS} (PEFT's layout); "
                               f"got {sorted(files)}")
        source = Path(staging_path) if staging_path else self.upload_dir(run_id, version)
        if not source.is_dir():
            raise PublishError(f"staging folder {source} does not exist on the weight server's volume")
        tmp = self._assemble(run_id, version, source, files, layout)
        final = self.folder(run_id, version)
        if final.exists():  # a previous attempt renamed but crashed before the row: replace it
            shutil.rmtree(final)
        os.replace(tmp, final)
        fsync_path(final.parent)
        msg = self._register(run_id, version, final, metrics, pinned)
        self.schedule_retention(run_id, best_metric)
        return msg

    def _check_layout(self, run_id: str, version: int, layout: dict) -> dict:
        if layout.get("kind", "full") == "full":
            return layout | {"base_version": None, "base_sha256": None}
        base_version = layout.get("base_version")
        base = self._row(run_id, base_version) if base_version is not None else None
        if base is None or not self.folder(run_id, base_version).is_dir():
            raise PublishError(f"delta v{version} names base version {base_version}, which this server does not "
                               "hold: publish a full snapshot (GET .../plan says which to send)")
        if not layout.get("tensors"):
            raise PublishError(f"delta v{version} lists no tensors: the manifest must state every tensor's digest")
        return layout | {"base_sha256": base.sha256}

    def _assemble(self, run_id: str, version: int, source: Path, files: dict[str, str], layout: dict) -> Path:
        tmp = self.root / str(uuid.UUID(run_id)) / f".tmp-v{version}-{uuid.uuid4().hex[:8]}"
        tmp.mkdir(parents=True)
        try:
            for name in files:
                src = source / check_name(name)
                if not src.is_file():
                    raise PublishError(f"{name}: declared by the publisher but not in {source}")
                os.replace(src, tmp / name) if _same_volume(src, tmp) else shutil.copyfile(src, tmp / name)
            trust = not self.verify_staging and not source.name.startswith(".upload-")
            entries = self._hash_and_sync(tmp, files, trust_declared=trust)
            _write_manifest(tmp, CheckpointManifest(run_id=run_id, version=version, files=entries, **layout))
            fsync_path(tmp)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        _remove_if_empty(source)  # files were moved out: the staging folder is spent
        return tmp

    @staticmethod
    def _hash_and_sync(folder: Path, files: dict[str, str], *, trust_declared: bool) -> dict[str, FileEntry]:
        """Hash each file once (for the manifest, checked against what the publisher declared) and fsync it.
        `trust_declared` (a co-located publisher with VERIFY_STAGING=false, the default): a declared sha256 is
        recorded without reading the file again; undeclared files are still hashed. Every file is hashed by
        pieces too (`FileEntry.pieces`: what rollout workers check and relay piece by piece)."""
        entries = {}
        for name, declared in sorted(files.items()):
            path = folder / name
            digest = declared if trust_declared and declared else sha256_file(path)
            if declared and digest != declared:
                raise PublishError(f"{name}: sha256 {digest} on disk differs from the declared {declared}")
            fsync_path(path)
            entries[name] = FileEntry(sha256=digest, bytes=path.stat().st_size, pieces=piece_hashes(path),
                                      piece_bytes=PIECE_BYTES)
        return entries

    def _register(self, run_id: str, version: int, folder: Path, metrics: dict[str, float],
                  pinned: bool = False) -> WeightsPublished:
        manifest_sha = hashlib.sha256((folder / MANIFEST).read_bytes()).hexdigest()
        manifest = read_manifest(folder, manifest_sha)
        row = dict(run_id=uuid.UUID(run_id), version=version, uri=self.uri(run_id, version), path=str(folder),
                   sha256=manifest_sha, bytes=manifest.total_bytes, metrics=metrics, status="available",
                   pinned=pinned)
        again = ["uri", "path", "sha256", "bytes", "status"] + (["pinned"] if pinned else [])  # reconcile keeps a pin
        with self.engine.begin() as c:
            c.execute(insert(Checkpoint).values(**row).on_conflict_do_update(
                index_elements=["run_id", "version"], set_={k: row[k] for k in again}))
        msg = self._message(row)
        announce(self.redis, WEIGHTS, msg, maxlen=10_000)
        log.info("published run %s v%d (%d bytes)", run_id, version, manifest.total_bytes)
        return msg

    def _message(self, row) -> WeightsPublished:
        get = row.get if isinstance(row, dict) else lambda k: getattr(row, k)
        return WeightsPublished(
            run_id=str(get("run_id")), version=get("version"), uri=get("uri"),
            path=get("path") if self.announce_path else None, sha256=get("sha256"), bytes=get("bytes"),
            created_at=time.time(),
        )

    def _row(self, run_id: str, version: int):
        with self.engine.connect() as c:
            return c.execute(select(Checkpoint).where(
                Checkpoint.run_id == uuid.UUID(run_id), Checkpoint.version == version,
                Checkpoint.status == "available")).first()

    # -- retention --------------------------------------------------------------------------------------------
    def schedule_retention(self, run_id: str, best_metric: str | None) -> Future:
        """`apply_retention` on the retention thread (passes run one after another, in publish order)."""
        def run() -> list[int]:
            try:
                return self.apply_retention(run_id, best_metric)
            except Exception:
                log.exception("retention of run %s failed; the next publish tries again", run_id)
                return []
        return self._retention.submit(run)

    def retain(self, run_id: str, keep_last: int) -> Future:
        """`apply_retention` with `keep_last` on the retention thread, after the passes already asked for; its
        future gives the versions deleted (a garbage collection of a finished run's older versions)."""
        return self._retention.submit(self.apply_retention, run_id, None, keep_last)

    def apply_retention(self, run_id: str, best_metric: str | None, keep_last: int | None = None) -> list[int]:
        """Keep the last `keep_last` versions (default: this server's KEEP_LAST), the best by `best_metric`
        (higher is better) and every pinned one, each with the snapshot and deltas it is built on."""
        with self.engine.connect() as c:
            rows = c.execute(select(Checkpoint.version, Checkpoint.metrics, Checkpoint.pinned).where(
                Checkpoint.run_id == uuid.UUID(run_id), Checkpoint.status == "available")
                .order_by(Checkpoint.version)).all()
        keep = {v for v, _, _ in rows[-(keep_last or self.keep_last):]} | {v for v, _, pinned in rows if pinned}
        scored = [(m[best_metric], v) for v, m, _ in rows if best_metric and best_metric in (m or {})]
        if scored:
            keep.add(max(scored)[1])
        keep = {v for kept in keep for v in self._chain(run_id, kept)}
        deleted = []
        for v in (v for v, _, _ in rows if v not in keep):
            with self.engine.begin() as c:  # a pin set since the read above wins: the version is then kept
                if not c.execute(update(Checkpoint).where(
                        Checkpoint.run_id == uuid.UUID(run_id), Checkpoint.version == v, Checkpoint.pinned.is_(False))
                        .values(status="deleted")).rowcount:
                    continue
            shutil.rmtree(self.folder(run_id, v), ignore_errors=True)
            deleted.append(v)
        return deleted

    def unpin(self, run_id: str, version: int) -> Future:
        """Clear `version`'s pin (no record names it any more) and run a retention pass on the retention thread,
        after those already asked for; its future gives the versions deleted. The pass keeps no best version:
        pins are Tinker sampler checkpoints', whose runs have none."""
        self._set_pinned(run_id, version, False)
        return self._retention.submit(self.apply_retention, run_id, None)

    def _set_pinned(self, run_id: str, version: int, pinned: bool) -> None:
        with self.engine.begin() as c:
            c.execute(update(Checkpoint).where(Checkpoint.run_id == uuid.UUID(run_id), Checkpoint.version == version)
                      .values(pinned=pinned))

    # -- restart ----------------------------------------------------------------------------------------------
    def reconcile(self) -> int:
        """Remove half-written temp folders; register and announce complete folders that lack a row."""
        fixed = 0
        for run_dir in (p for p in self.root.iterdir() if p.is_dir()):
            for tmp in run_dir.glob(".tmp-v*"):
                shutil.rmtree(tmp, ignore_errors=True)
            for folder in run_dir.glob("v*"):
                if (folder / MANIFEST).is_file() and self._row(run_dir.name, int(folder.name[1:])) is None:
                    try:
                        self._register(run_dir.name, int(folder.name[1:]), folder, {})
                        fixed += 1
                    except (ChecksumError, ValueError) as e:
                        log.error("cannot register %s: %s", folder, e)
        return fixed

    def list_versions(self, run_id: str) -> list[dict]:
        with self.engine.connect() as c:
            rows = c.execute(select(Checkpoint).where(Checkpoint.run_id == uuid.UUID(run_id),
                                                      Checkpoint.status == "available")
                             .order_by(Checkpoint.version)).all()
        return [dict(version=r.version, uri=r.uri, path=r.path, sha256=r.sha256, bytes=r.bytes, metrics=r.metrics)
                for r in rows]


def _write_manifest(folder: Path, manifest: CheckpointManifest) -> None:
    with open(folder / MANIFEST, "wb") as f:
        f.write(manifest.model_dump_json(indent=1).encode())
        f.flush()
        os.fsync(f.fileno())


def _remove_if_empty(folder: Path) -> None:
    try:
        folder.rmdir()
    except OSError:
        pass


def _same_volume(a: Path, b: Path) -> bool:
    return os.stat(a).st_dev == os.stat(b).st_dev
