"""Datasets stored in Postgres (tables `datasets` + `dataset_rows`), in the spirit of rLLM's DatasetRegistry.

    registry = DatasetRegistry(engine)
    registry.register("gsm8k-tiny", rows, split="train")        # replaces an existing (name, split)
    ds = registry.load("gsm8k-tiny", "train")                   # Dataset: .rows, .task_ids, len(), repeat(n)
    registry.splits("gsm8k-tiny"); registry.list(); registry.delete("gsm8k-tiny")

File loaders (`load_rows`) read jsonl, csv, parquet and HF `datasets` folders saved with `save_to_disk`.
Every row must be a JSON object; a row's task id is its "task_id" or "id" field if present, else its index.
Validation errors name the row and what is wrong, so a user can fix the file.
"""

from __future__ import annotations

import csv
import io
import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sqlalchemy import Engine, delete, func, insert, select

from shared.db.models import Dataset as DatasetModel
from shared.db.models import DatasetRow

NAME_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.\-]{0,199}$")
MAX_TASK_ID_CHARS = 200
_INSERT_CHUNK = 1000


class DatasetError(ValueError):
    """Bad dataset input: the message says which row or field is wrong and how to fix it."""


class DatasetNotFound(KeyError):
    def __str__(self) -> str:
        return str(self.args[0]) if self.args else "dataset not found"


@dataclass
class Dataset:
    """Rows of one (name, split) in index order."""

    name: str
    split: str
    rows: list[dict[str, Any]]
    task_ids: list[str] = field(default_factory=list)
    info: dict[str, Any] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict[str, Any]:
        return self.rows[i]

    def repeat(self, n: int) -> Dataset:
        """Each row n times in a row (rLLM's `repeat`), e.g. for pass@k evaluation without sample indices."""
        if n < 1:
            raise DatasetError(f"repeat(n) needs n >= 1, got {n}")
        rows = [r for r in self.rows for _ in range(n)]
        ids = [t for t in self.task_ids for _ in range(n)]
        return Dataset(self.name, self.split, rows, ids, dict(self.info))


def validate_name(name: str, what: str = "name") -> str:
    if not isinstance(name, str) or not NAME_PATTERN.match(name):
        raise DatasetError(
            f"{what} {name!r} is invalid: use 1-200 letters, digits, '_', '-' or '.', starting with a letter or digit"
        )
    return name


def _clean(value: Any) -> Any:
    """JSON-safe copy: NaN/inf become null (Postgres JSONB rejects them), numpy/arrow scalars become Python."""
    if isinstance(value, float):
        return None if math.isnan(value) or math.isinf(value) else value
    if isinstance(value, dict):
        return {str(k): _clean(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_clean(v) for v in value]
    if hasattr(value, "tolist"):  # numpy arrays and scalars
        return _clean(value.tolist())
    if hasattr(value, "isoformat"):
        return value.isoformat()
    if isinstance(value, bytes):
        return value.decode("utf-8", errors="replace")
    return value


def task_id_of(row: dict[str, Any], idx: int) -> str:
    raw = row.get("task_id", row.get("id"))
    return str(idx) if raw is None else str(raw)


def validate_rows(rows: list[Any]) -> list[dict[str, Any]]:
    """Check every row is an object with a usable, unique task id; return JSON-safe copies."""
    if not rows:
        raise DatasetError("the dataset has no rows: provide at least one JSON object per line/record")
    out, seen = [], {}
    for i, row in enumerate(rows):
        if not isinstance(row, dict):
            raise DatasetError(f"row {i}: expected a JSON object, got {type(row).__name__}")
        row = _clean(row)
        tid = task_id_of(row, i)
        if not tid or len(tid) > MAX_TASK_ID_CHARS:
            raise DatasetError(f"row {i}: task id must be 1-{MAX_TASK_ID_CHARS} characters, got {tid!r}")
        if tid in seen:
            raise DatasetError(f"row {i}: duplicate task id {tid!r} (also row {seen[tid]}); task ids must be unique")
        seen[tid] = i
        out.append(row)
    return out


# ---- file loaders -------------------------------------------------------------------------------------------


def rows_from_jsonl(data: bytes | str) -> list[Any]:
    text = data.decode("utf-8") if isinstance(data, bytes) else data
    rows = []
    for n, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError as e:
            raise DatasetError(f"line {n}: not valid JSON ({e.msg} at column {e.colno})") from e
    return rows


def rows_from_csv(data: bytes | str) -> list[Any]:
    text = data.decode("utf-8") if isinstance(data, bytes) else data
    return [dict(r) for r in csv.DictReader(io.StringIO(text))]


def rows_from_parquet(data: bytes | str | Path) -> list[Any]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    source = pa.BufferReader(data) if isinstance(data, bytes) else str(data)
    try:
        return pq.read_table(source).to_pylist()
    except (pa.ArrowInvalid, OSError) as e:
        raise DatasetError(f"not a readable parquet file ({e})") from e


def rows_from_hf_folder(path: str | Path) -> list[Any]:
    import datasets

    try:
        ds = datasets.load_from_disk(str(path))
    except (FileNotFoundError, ValueError) as e:
        raise DatasetError(f"{path}: not a HF `datasets` folder saved with save_to_disk ({e})") from e
    if isinstance(ds, datasets.DatasetDict):
        raise DatasetError(f"{path}: holds splits {list(ds)}; point at one split's folder")
    return ds.to_list()


FORMATS = ("jsonl", "csv", "parquet", "hf")


def detect_format(filename: str) -> str:
    name = filename.lower()
    for suffix, fmt in ((".jsonl", "jsonl"), (".json", "jsonl"), (".csv", "csv"), (".parquet", "parquet")):
        if name.endswith(suffix):
            return fmt
    raise DatasetError(f"{filename!r}: unknown format; use .jsonl, .csv, .parquet or a HF datasets folder")


def rows_from_bytes(data: bytes, fmt: str) -> list[Any]:
    loaders = {"jsonl": rows_from_jsonl, "csv": rows_from_csv, "parquet": rows_from_parquet}
    if fmt not in loaders:
        raise DatasetError(f"format {fmt!r} cannot be uploaded; use one of {', '.join(loaders)}")
    return loaders[fmt](data)


def load_rows(path: str | Path, fmt: str | None = None) -> list[Any]:
    """Rows of a local file or HF `datasets` folder; the format comes from the suffix unless given."""
    path = Path(path)
    if not path.exists():
        raise DatasetError(f"{path}: no such file or folder")
    if path.is_dir():
        return rows_from_hf_folder(path)
    fmt = fmt or detect_format(path.name)
    if fmt == "parquet":
        return rows_from_parquet(path)
    return rows_from_bytes(path.read_bytes(), fmt)


# ---- the registry -------------------------------------------------------------------------------------------


class DatasetRegistry:
    """Datasets in Postgres. Synchronous (SQLAlchemy Engine); the API calls it from a worker thread."""

    def __init__(self, engine: Engine):
        self.engine = engine

    def register(
        self, name: str, rows: list[Any], split: str = "train", *, source: str = "", info: dict | None = None
    ) -> dict[str, Any]:
        """Validate and store rows under (name, split), replacing what was there, in one transaction."""
        validate_name(name)
        validate_name(split, "split")
        clean = validate_rows(list(rows))
        with self.engine.begin() as conn:
            conn.execute(delete(DatasetModel).where(DatasetModel.name == name, DatasetModel.split == split))
            ds_id = conn.execute(
                insert(DatasetModel)
                .values(name=name, split=split, source=source, num_rows=len(clean), info=info or {})
                .returning(DatasetModel.id)
            ).scalar_one()
            records = [
                {"dataset_id": ds_id, "idx": i, "task_id": task_id_of(r, i), "data": r,
                 "data_source": str(r.get("data_source", ""))[:200]}
                for i, r in enumerate(clean)
            ]
            for start in range(0, len(records), _INSERT_CHUNK):
                conn.execute(insert(DatasetRow), records[start:start + _INSERT_CHUNK])
        return self.describe(name, split)

    def _dataset(self, conn, name: str, split: str) -> Any:
        row = conn.execute(
            select(DatasetModel).where(DatasetModel.name == name, DatasetModel.split == split)
        ).first()
        if row is None:
            raise DatasetNotFound(f"dataset {name!r} has no split {split!r}; registered: {self.splits(name) or 'none'}")
        return row  # a Core row: columns by attribute (id, name, split, ...)

    def describe(self, name: str, split: str = "train") -> dict[str, Any]:
        with self.engine.connect() as conn:
            ds = self._dataset(conn, name, split)
        return _describe(ds)

    def load(self, name: str, split: str = "train", *, offset: int = 0, limit: int | None = None) -> Dataset:
        with self.engine.connect() as conn:
            ds = self._dataset(conn, name, split)
            q = (select(DatasetRow.task_id, DatasetRow.data).where(DatasetRow.dataset_id == ds.id)
                 .order_by(DatasetRow.idx).offset(offset).limit(limit))
            rows = conn.execute(q).all()
        return Dataset(name, split, [r.data for r in rows], [r.task_id for r in rows], dict(ds.info))

    def exists(self, name: str, split: str | None = None) -> bool:
        splits = self.splits(name)
        return bool(splits) if split is None else split in splits

    def splits(self, name: str) -> list[str]:
        with self.engine.connect() as conn:
            q = select(DatasetModel.split).where(DatasetModel.name == name).order_by(DatasetModel.split)
            return list(conn.execute(q).scalars())

    def list(self) -> list[dict[str, Any]]:
        with self.engine.connect() as conn:
            q = select(DatasetModel).order_by(DatasetModel.name, DatasetModel.split)
            return [_describe(d) for d in conn.execute(q)]

    def delete(self, name: str, split: str | None = None) -> int:
        """Delete one split, or every split of `name`; returns how many splits went. Rows cascade."""
        q = delete(DatasetModel).where(DatasetModel.name == name)
        if split is not None:
            q = q.where(DatasetModel.split == split)
        with self.engine.begin() as conn:
            n = conn.execute(q).rowcount
        if n == 0:
            raise DatasetNotFound(f"dataset {name!r}" + (f" split {split!r}" if split else "") + " does not exist")
        return n


def _describe(ds: Any) -> dict[str, Any]:
    return {
        "id": str(ds.id), "name": ds.name, "split": ds.split, "source": ds.source, "num_rows": ds.num_rows,
        "info": ds.info, "created_at": ds.created_at.isoformat() if ds.created_at else None,
    }


def count_rows(engine: Engine, name: str, split: str) -> int | None:
    """Rows in (name, split), or None when it does not exist (cheap check for run validation)."""
    with engine.connect() as conn:
        q = select(func.coalesce(func.max(DatasetModel.num_rows), -1)).where(
            DatasetModel.name == name, DatasetModel.split == split
        )
        n = conn.execute(q).scalar_one()
    return None if n < 0 else n
