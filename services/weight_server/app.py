"""HTTP routes of the weight server (mounted on the ServiceRuntime's app, next to /healthz and /metrics):
uploads, the delta-or-full plan, publish, the versions list and retention, streamed downloads (Range resumes)
and the relay chain's sources.

More: docs/weight-sync.md#the-weight-servers-routes
"""

from __future__ import annotations

import asyncio
import uuid
from typing import Literal

from fastapi import APIRouter, HTTPException, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import FileResponse
from prometheus_client import Counter, Histogram
from pydantic import BaseModel, Field

from services.weight_server.chains import RelayChains
from services.weight_server.store import CheckpointStore, PublishError, check_name
from shared.weights.manifest import MANIFEST, BaseModelRef, ChecksumError, TensorEntry

PUBLISHED = Counter("weight_server_published_total", "Checkpoint versions published")
REJECTED = Counter("weight_server_rejected_total", "Publishes or uploads rejected", ["reason"])
PUBLISH_SECONDS = Histogram("weight_server_publish_seconds", "Publish request duration")
BYTES_SERVED = Counter("weight_server_bytes_served_total", "Checkpoint bytes requested for download")


class PublishRequest(BaseModel):
    files: dict[str, str] = Field(description="file name -> sha256 ('' lets the server hash it)")
    metrics: dict[str, float] = Field(default_factory=dict)
    staging_path: str | None = Field(None, description="co-located trainer: folder on the shared volume")
    best_metric: str | None = Field(None, description="metric that picks the 'best' version kept by retention")
    kind: Literal["full", "delta"] = Field("full", description="a full snapshot, or a delta file on base_version")
    base_version: int | None = Field(None, description="delta: the version it applies to (see GET .../plan)")
    tensors: dict[str, TensorEntry] = Field(
        default_factory=dict, description="every tensor of the version's full weights: dtype, shape, xxh3-128 digest")
    full_bytes: int = Field(0, ge=0, description="size of the full weights this version stands for")
    base_model: BaseModelRef | None = Field(
        None, description="a LoRA version (the adapter alone, PEFT layout): the base model it belongs to")
    pinned: bool = Field(False, description="kept by retention, with what it is built on, until DELETE .../pin "
                         "(a named Tinker sampler checkpoint)")


class PublishPlan(BaseModel):
    base_version: int | None = Field(description="send a delta on this version; None: send a full snapshot")
    base_sha256: str | None = Field(description="sha256 of the base version's MANIFEST.json")


def _run(run_id: str) -> str:
    try:
        return str(uuid.UUID(run_id))
    except ValueError:
        raise HTTPException(422, f"run id {run_id!r} is not a UUID") from None


class RetainRequest(BaseModel):
    keep_last: int = Field(ge=1, le=1_000_000, description="newest versions kept, each with the snapshot and "
                           "deltas it is built on")


class RetainResult(BaseModel):
    deleted: list[int] = Field(description="versions deleted (files and their `checkpoints` rows marked deleted)")


class RelaySource(BaseModel):
    source: str | None = Field(description="base URL of the worker to fetch from; None: this weight server")


def _range_start(header: str | None) -> int:
    """Where a `Range: bytes=<start>-` request (a resumed download) starts; 0 for anything else."""
    first = (header or "").removeprefix("bytes=").split("-", 1)[0]
    return int(first) if first.isdigit() and "," not in (header or "") else 0


def build_router(store: CheckpointStore, chains: RelayChains | None = None) -> APIRouter:
    router = APIRouter(prefix="/v1/runs/{run_id}/versions")
    chains = chains or RelayChains()

    @router.put("/{version}/files/{name}")
    async def upload(run_id: str, version: int, name: str, request: Request, sha256: str | None = None) -> dict:
        try:
            upload = store.open_upload(_run(run_id), version, name)
        except PublishError as e:
            REJECTED.labels("bad_request").inc()
            raise HTTPException(422, str(e)) from None
        try:
            async for chunk in request.stream():
                await run_in_threadpool(upload.write, chunk)  # disk writes off the event loop
        except BaseException:
            upload.abort()
            raise
        try:
            size = await run_in_threadpool(upload.finish, sha256)
        except PublishError as e:
            REJECTED.labels("checksum").inc()
            raise HTTPException(422, str(e)) from None
        return {"name": name, "bytes": size}

    @router.post("/{version}/publish")
    async def publish(run_id: str, version: int, body: PublishRequest) -> dict:
        try:
            layout = body.model_dump(include={"kind", "base_version", "tensors", "full_bytes", "base_model"})
            with PUBLISH_SECONDS.time():
                msg = await run_in_threadpool(store.publish, _run(run_id), version, body.files, body.metrics,
                                              body.staging_path, body.best_metric, layout, body.pinned)
        except (PublishError, ChecksumError) as e:
            REJECTED.labels("checksum" if "sha256" in str(e) else "bad_request").inc()
            raise HTTPException(422, str(e)) from None
        PUBLISHED.inc()
        return msg.model_dump(mode="json")

    @router.get("/{version}/plan", response_model=PublishPlan)
    async def plan(run_id: str, version: int) -> PublishPlan:
        return PublishPlan(**await run_in_threadpool(store.plan, _run(run_id), version))

    @router.get("")
    async def versions(run_id: str) -> list[dict]:
        return await run_in_threadpool(store.list_versions, _run(run_id))

    @router.post("/retain", response_model=RetainResult)
    async def retain(run_id: str, body: RetainRequest) -> RetainResult:
        return RetainResult(deleted=await asyncio.wrap_future(store.retain(_run(run_id), body.keep_last)))

    @router.delete("/{version}/pin", response_model=RetainResult)
    async def unpin(run_id: str, version: int) -> RetainResult:
        """Retention may remove the version again; the pass this runs says what it deleted."""
        return RetainResult(deleted=await asyncio.wrap_future(store.unpin(_run(run_id), version)))

    @router.get("/{version}/sources/{name}", response_model=RelaySource)
    def source(run_id: str, version: int, name: str, peer: str, failed: str | None = None) -> RelaySource:
        for url in (peer, failed):
            if url is not None and not url.startswith(("http://", "https://")):
                raise HTTPException(422, f"{url!r} is not a worker's base URL (http://host:port)")
        if not (store.folder(_run(run_id), version) / MANIFEST).is_file():
            raise HTTPException(404, f"run {run_id} has no version {version}")
        return RelaySource(source=chains.source(_run(run_id), version, name, peer.rstrip("/"),
                                                failed.rstrip("/") if failed else None))

    @router.get("/{version}/{name}")
    async def download(run_id: str, version: int, name: str, request: Request) -> FileResponse:
        if name != "MANIFEST.json":
            try:
                check_name(name)
            except PublishError as e:
                raise HTTPException(422, str(e)) from None
        path = store.folder(_run(run_id), version) / name
        if not path.is_file():
            raise HTTPException(404, f"run {run_id} version {version} has no file {name}")
        BYTES_SERVED.inc(max(0, path.stat().st_size - _range_start(request.headers.get("range"))))
        return FileResponse(path, media_type="application/octet-stream")

    return router
