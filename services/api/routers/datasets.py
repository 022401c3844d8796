"""Datasets: upload (jsonl, csv, parquet), import (server-side file/folder or built-in generator), list, show,
preview rows, delete. Each upload or import of a (name, split) adds an immutable version; runs pin one.

The jobs worker is the one writer of datasets: an upload is checked here (a bad file is answered 400 at once),
written under DATA_DIR/uploads (the volume the API and the jobs worker share) and imported by a job; a delete is
a job too. Both routes wait for their job (DATASET_JOB_WAIT_S) and answer with its outcome, or 202 with the job
when it has not finished in time: it is queued, not lost. With no jobs service to queue it they answer 503, and
the uploaded file is removed: nothing was stored and nothing will be."""

from __future__ import annotations

import uuid
from typing import Annotated, Any, Literal

from fastapi import APIRouter, File, Form, Query, Request, Response, UploadFile
from fastapi.encoders import jsonable_encoder
from fastapi.responses import JSONResponse
from pydantic import ConfigDict, Field, model_validator

from services.api.deps import DB, Config
from services.api.errors import ApiError, Int, StrictBody, errors
from services.api.job_queue import job_out, submit_job, wait_for_job
from services.api.schemas import DatasetDetail, DatasetPublic, DatasetRowsPage, JobPublic, Page
from shared.stores.datasets import (
    DatasetCatalog,
    DatasetError,
    DatasetNotFound,
    detect_format,
    rows_from_bytes,
    validate_rows,
)

router = APIRouter(prefix="/datasets", tags=["datasets"])
Name = Annotated[str, Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.\-]{0,199}$")]


def catalog(request: Request) -> DatasetCatalog:
    return DatasetCatalog(request.app.state.engine)


@router.get("", response_model=Page[DatasetPublic])
def list_datasets(request: Request) -> dict:
    items = catalog(request).list()
    return {"data": items, "count": len(items)}


@router.post("", status_code=201, response_model=DatasetPublic, responses=errors(400, 409, 413, 422) | {
    202: {"model": JobPublic, "description": "stored by a job that has not finished yet: follow GET /v1/jobs/{id}"}})
def upload_dataset(
    request: Request, config: Config, session: DB, file: Annotated[UploadFile, File(description="jsonl, csv or parquet")],
    name: Annotated[str, Form(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.\-]{0,199}$")],
    split: Annotated[str, Form(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.\-]{0,63}$")] = "train",
    # not nullable in the schema: a multipart form has no null (leave the field out to detect the format)
    format: Annotated[Literal["jsonl", "csv", "parquet"], Form(description="default: from the file name")] = None,  # type: ignore[assignment]
) -> Any:
    """Upload a file; rows are validated (objects, unique task ids) and stored as the next version of
    (name, split). Earlier versions stay as they were for the runs that read them. 400 when the file's content
    is not a valid dataset (the message says which row and why)."""
    data = file.file.read(config.max_upload_mb * 2**20 + 1)
    if len(data) > config.max_upload_mb * 2**20:
        raise ApiError(413, f"file exceeds {config.max_upload_mb} MiB", field="file",
                       hint="import it from a path on the API's machine: POST /v1/datasets/import")
    try:
        fmt = format or detect_format(file.filename or "")
        validate_rows(rows_from_bytes(data, fmt))
    except DatasetError as e:
        raise ApiError(400, f"dataset {name!r}: {e}", field="file",
                       hint="jsonl/csv/parquet of JSON objects, one task per row; name the format with `format`") from e
    uploads = config.data_dir / "uploads"
    uploads.mkdir(parents=True, exist_ok=True)
    path = uploads / f"{uuid.uuid4().hex}.{fmt}"
    tmp = path.with_suffix(".tmp")
    tmp.write_bytes(data)
    tmp.rename(path)  # the job never reads half a file
    try:
        job = submit_job(request, session, "import_dataset", {
            "name": name, "split": split, "path": str(path), "format": fmt, "upload": file.filename or ""})
    except ApiError:
        path.unlink(missing_ok=True)  # no job was queued (503): nobody will import the file
        raise
    return _outcome(request, config, job, lambda done: done.result)


def _outcome(request: Request, config: Config, job: dict, answer) -> Any:
    """The finished job's answer; its refusal as 400, 404 or 409; or 202 with the job still to finish (at once
    when DATASET_JOB_WAIT_S is 0)."""
    if config.dataset_job_wait_s == 0:
        return JSONResponse(status_code=202, content=jsonable_encoder(job))
    done = wait_for_job(request.app.state.engine, job["id"], config.dataset_job_wait_s)
    if done.status not in ("succeeded", "failed"):
        return JSONResponse(status_code=202, content=jsonable_encoder(job_out(done)))
    if done.status == "failed":
        refused = (done.result or {}).get("refused")
        status = {"not_found": 404, "in_use": 409, "invalid": 400}.get(refused, 500)
        raise ApiError(status, f"job {done.id}: {(done.error or '').splitlines()[0] if done.error else 'failed'}",
                       hint="stop the runs that read it first, or delete another version" if status == 409 else None)
    return answer(done)


class ImportRequest(StrictBody):
    """Exactly one source: `path` (a server-side file or folder) or `generator` (a built-in name)."""

    # The one-source rule, in the schema too, so clients and fuzzers know it.
    model_config = ConfigDict(strict=True, json_schema_extra={"oneOf": [
        {"required": ["path"], "properties": {"path": {"type": "string"}, "generator": {"type": "null"}}},
        {"required": ["generator"], "properties": {"generator": {"type": "string"}, "path": {"type": "null"}}},
    ]})

    name: Name
    split: Annotated[str, Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.\-]{0,63}$")] = "train"
    path: str | None = Field(None, max_length=4096, description="file or HF datasets folder on the server")
    format: Literal["jsonl", "csv", "parquet", "hf"] | None = None
    generator: str | None = Field(None, max_length=100, description="built-in generator name")
    n: Int = Field(100, ge=1, le=1_000_000, description="generator: rows to make")
    seed: Int = Field(0, ge=0, le=2**31 - 1)

    @model_validator(mode="after")
    def _one_source(self) -> ImportRequest:
        if (self.path is None) == (self.generator is None):
            raise ValueError("give exactly one of `path` (a server-side file) or `generator` (a built-in name)")
        return self


@router.post("/import", status_code=202, response_model=JobPublic, responses=errors(400, 422, 503))
def import_dataset(body: ImportRequest, request: Request, session: DB) -> dict:
    """Queue an import job; poll GET /v1/jobs/{id} for its outcome (rows, or the validation error)."""
    return submit_job(request, session, "import_dataset", body.model_dump())


@router.get("/{name}", response_model=DatasetDetail, responses=errors(404, 422))
def show_dataset(name: str, request: Request) -> dict:
    reg = catalog(request)
    splits = reg.splits(name)
    if not splits:
        raise ApiError(404, f"dataset {name!r} does not exist", field="name", hint="list them with GET /v1/datasets")
    return {"name": name, "splits": {s: reg.describe(name, s) | {"versions": reg.versions(name, s)} for s in splits}}


@router.get("/{name}/rows", response_model=DatasetRowsPage, responses=errors(404, 422))
def preview_rows(name: str, request: Request, split: Annotated[str, Query(max_length=64)] = "train",
                 offset: Annotated[int, Query(ge=0, le=2**31 - 1)] = 0,
                 limit: Annotated[int, Query(ge=1, le=1000)] = 20,
                 version: Annotated[int | None, Query(ge=1, le=2**31 - 1, description="default: the latest")] = None,
                 ) -> dict:
    try:
        ds = catalog(request).load(name, split, version, offset=offset, limit=limit)
    except DatasetNotFound as e:
        raise ApiError(404, str(e), field="name") from e
    return {"name": name, "split": split, "version": ds.version, "offset": offset,
            "count": catalog(request).describe(name, split, ds.version)["num_rows"],
            "data": [{"idx": offset + i, "task_id": t, "data": r}
                     for i, (t, r) in enumerate(zip(ds.task_ids, ds.rows, strict=True))]}


@router.delete("/{name}", status_code=204, response_class=Response, responses=errors(404, 409, 422) | {
    202: {"model": JobPublic, "description": "deleted by a job that has not finished yet: follow GET /v1/jobs/{id}"}})
def delete_dataset(name: str, request: Request, config: Config, session: DB,
                   split: Annotated[str | None, Query(max_length=64)] = None,
                   version: Annotated[int | None, Query(ge=1, le=2**31 - 1)] = None) -> Response:
    """Delete one version (`split=` and `version=`), one split (every version) or all of them. 409 while a run
    that has not ended reads any of them."""
    if not catalog(request).exists(name, split):
        raise ApiError(404, f"dataset {name!r}" + (f" split {split!r}" if split else "") + " does not exist",
                       field="name", hint="list them with GET /v1/datasets")
    job = submit_job(request, session, "delete_dataset",
                     {"name": name, "split": split, "version": version})
    return _outcome(request, config, job, lambda done: Response(status_code=204))
