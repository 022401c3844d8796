"""Exports: a Tinker model's adapter in PEFT's layout (its `save_weights_external`), kept for its owner to
download, apart from the run's versions (rollout workers never load them, retention never counts them).

WEIGHTS_DIR/exports/<run_id>/<name>/ holds the files. An export arrives file by file (each checked against its
sha256) into a hidden upload folder, and `commit` renames the whole folder into place: a reader finds the old
export or the new one, never half of one.
"""

from __future__ import annotations

import shutil
import uuid
from pathlib import Path

from fastapi import APIRouter, HTTPException, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import FileResponse
from pydantic import BaseModel, Field

from services.weight_server.store import PublishError, Upload, check_name
from shared.contracts.tinker_run import checkpoint_name_ok
from shared.weights.manifest import fsync_path, fsync_tree


class ExportStore:
    def __init__(self, root: Path):
        self.root = root / "exports"

    def folder(self, run_id: str, name: str, upload: bool = False) -> Path:
        try:
            run = str(uuid.UUID(run_id))
        except ValueError:
            raise PublishError(f"run id {run_id!r} is not a UUID") from None
        if not checkpoint_name_ok(name):
            raise PublishError(f"bad export name {name!r}: 1-128 letters, digits, '.', '_' or '-', not starting "
                               "with '.'")
        return self.root / run / (f".upload-{name}" if upload else name)

    def open_upload(self, run_id: str, name: str, file: str) -> Upload:
        folder = self.folder(run_id, name, upload=True)
        folder.mkdir(parents=True, exist_ok=True)
        return Upload(folder / check_name(file))

    def commit(self, run_id: str, name: str, files: list[str]) -> dict[str, int]:
        """The uploaded files, exactly `files`, become the export `name` (replacing one of that name); their
        sizes."""
        upload, final = self.folder(run_id, name, upload=True), self.folder(run_id, name)
        have = {p.name for p in upload.iterdir()} if upload.is_dir() else set()
        if have != set(files) or not files:
            raise PublishError(f"export {name}: uploaded {sorted(have)}, committing {sorted(files)}: upload each "
                               "file first")
        fsync_tree(upload)
        stale = final.with_name(f".stale-{name}-{uuid.uuid4().hex[:6]}")
        if final.exists():
            final.rename(stale)
        upload.rename(final)
        fsync_path(final.parent)
        shutil.rmtree(stale, ignore_errors=True)
        return {f: (final / f).stat().st_size for f in sorted(files)}

    def file(self, run_id: str, name: str, file: str) -> Path | None:
        path = self.folder(run_id, name) / check_name(file)
        return path if path.is_file() else None

    def delete(self, run_id: str, name: str) -> bool:
        """Remove the export (and any upload of that name left half done); whether there was one."""
        final = self.folder(run_id, name)
        existed = final.is_dir()
        shutil.rmtree(final, ignore_errors=True)
        shutil.rmtree(self.folder(run_id, name, upload=True), ignore_errors=True)
        return existed


class Commit(BaseModel):
    files: list[str] = Field(min_length=1, description="the export's files, each uploaded before")


def build_exports_router(exports: ExportStore) -> APIRouter:
    router = APIRouter(prefix="/v1/exports/{run_id}/{name}")

    def checked(call, *args):
        try:
            return call(*args)
        except PublishError as e:
            raise HTTPException(422, str(e)) from None

    @router.put("/files/{file}")
    async def upload(run_id: str, name: str, file: str, request: Request, sha256: str | None = None) -> dict:
        upload = checked(exports.open_upload, run_id, name, file)
        try:
            async for chunk in request.stream():
                await run_in_threadpool(upload.write, chunk)
        except BaseException:
            upload.abort()
            raise
        return {"name": file, "bytes": checked(upload.finish, sha256)}

    @router.post("/commit")
    async def commit(run_id: str, name: str, body: Commit) -> dict:
        return {"files": await run_in_threadpool(checked, exports.commit, run_id, name, body.files)}

    @router.get("/files/{file}")
    async def download(run_id: str, name: str, file: str) -> FileResponse:
        path = checked(exports.file, run_id, name, file)
        if path is None:
            raise HTTPException(404, f"run {run_id} has no export {name} with a file {file}")
        return FileResponse(path, media_type="application/octet-stream")

    @router.delete("", status_code=204)
    async def delete(run_id: str, name: str) -> None:
        await run_in_threadpool(checked, exports.delete, run_id, name)

    return router
