"""Datasets: upload (jsonl, csv, parquet), import (server-side file/folder or built-in generator, as a job),
list, show, preview rows, delete."""

from __future__ import annotations

from typing import Annotated, Literal

from fastapi import APIRouter, File, Form, HTTPException, Query, Request, Response, UploadFile
from pydantic import BaseModel, Field, model_validator

from services.api.deps import DB, Config
from services.api.job_queue import submit_job
from shared.datasets import DatasetError, DatasetNotFound, DatasetRegistry, detect_format, rows_from_bytes

router = APIRouter(prefix="/datasets", tags=["datasets"])
Name = Annotated[str, Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.\-]{0,199}$")]


def registry(request: Request) -> DatasetRegistry:
    return DatasetRegistry(request.app.state.engine)


@router.get("")
def list_datasets(request: Request) -> dict:
    return {"items": registry(request).list()}


@router.post("", status_code=201)
def upload_dataset(
    request: Request, config: Config, file: Annotated[UploadFile, File(description="jsonl, csv or parquet")],
    name: Annotated[str, Form(max_length=200)], split: Annotated[str, Form(max_length=64)] = "train",
    format: Annotated[Literal["jsonl", "csv", "parquet"] | None, Form()] = None,
) -> dict:
    """Upload a file; rows are validated (objects, unique task ids) and replace any existing (name, split)."""
    data = file.file.read(config.max_upload_mb * 2**20 + 1)
    if len(data) > config.max_upload_mb * 2**20:
        raise HTTPException(413, f"file exceeds {config.max_upload_mb} MiB; import it from a path instead")
    try:
        fmt = format or detect_format(file.filename or "")
        rows = rows_from_bytes(data, fmt)
        return registry(request).register(name, rows, split, source=f"upload:{file.filename}", info={"format": fmt})
    except DatasetError as e:
        raise HTTPException(422, f"dataset {name!r}: {e}") from e


class ImportRequest(BaseModel):
    name: Name
    split: Annotated[str, Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.\-]{0,63}$")] = "train"
    path: str | None = Field(None, max_length=4096, description="file or HF datasets folder on the server")
    format: Literal["jsonl", "csv", "parquet", "hf"] | None = None
    generator: str | None = Field(None, max_length=100, description="built-in generator name")
    n: int = Field(100, ge=1, le=1_000_000, description="generator: rows to make")
    seed: int = Field(0, ge=0, le=2**31 - 1)

    @model_validator(mode="after")
    def _one_source(self) -> ImportRequest:
        if (self.path is None) == (self.generator is None):
            raise ValueError("give exactly one of `path` (a server-side file) or `generator` (a built-in name)")
        return self


@router.post("/import", status_code=202)
def import_dataset(body: ImportRequest, request: Request, session: DB) -> dict:
    """Queue an import job; poll GET /v1/jobs/{id} for its outcome (rows, or the validation error)."""
    return submit_job(session, request.app.state.celery, "import_dataset", body.model_dump())


@router.get("/{name}")
def show_dataset(name: str, request: Request) -> dict:
    reg = registry(request)
    splits = reg.splits(name)
    if not splits:
        raise HTTPException(404, f"dataset {name!r} does not exist")
    return {"name": name, "splits": {s: reg.describe(name, s) for s in splits}}


@router.get("/{name}/rows")
def preview_rows(name: str, request: Request, split: Annotated[str, Query(max_length=64)] = "train",
                 offset: Annotated[int, Query(ge=0, le=2**31 - 1)] = 0,
                 limit: Annotated[int, Query(ge=1, le=1000)] = 20) -> dict:
    try:
        ds = registry(request).load(name, split, offset=offset, limit=limit)
    except DatasetNotFound as e:
        raise HTTPException(404, str(e)) from e
    return {"name": name, "split": split, "offset": offset,
            "items": [{"idx": offset + i, "task_id": t, "data": r} for i, (t, r) in enumerate(zip(ds.task_ids, ds.rows, strict=True))]}


@router.delete("/{name}", status_code=204)
def delete_dataset(name: str, request: Request, split: Annotated[str | None, Query(max_length=64)] = None) -> Response:
    """Delete one split (`split=`) or all of them."""
    try:
        registry(request).delete(name, split)
    except DatasetNotFound as e:
        raise HTTPException(404, str(e)) from e
    return Response(status_code=204)
