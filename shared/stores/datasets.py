"""Datasets stored in Postgres (tables `datasets` + `dataset_rows`), in the spirit of rLLM's DatasetRegistry.

    registry = DatasetRegistry(engine)
    registry.register("gsm8k-tiny", rows, split="train")        # a new version: 1, then 2, ...

Versions are immutable: registering a (name, split) again adds version n+1 and leaves earlier versions' rows
alone. A version that a run not yet stopped, completed or failed pins cannot be deleted. `load_rows` reads
jsonl, csv, parquet and HF `datasets` folders; validation errors name the row.

More: docs/datasets.md#the-registry-in-python
"""

from __future__ import annotations

import csv
import difflib
import io
import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sqlalchemy import Connection, Engine, Integer, Text, and_, cast, delete, func, insert, select
from sqlalchemy.orm import aliased

from shared.contracts.db.models import TERMINAL_RUN_STATUSES, Dataset, DatasetRow, Run

NAME_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.\-]{0,199}$")
MAX_TASK_ID_CHARS = 200
_INSERT_CHUNK = 1000


class DatasetError(ValueError):
    """Bad dataset input: the message says which row or field is wrong and how to fix it."""


class DatasetNotFound(KeyError):
    def __str__(self) -> str:
        return str(self.args[0]) if self.args else "dataset not found"


class DatasetInUse(DatasetError):
    """A version some unfinished run reads: it may be deleted once those runs end (or are stopped)."""

    def __init__(self, name: str, runs: list[tuple[str, str, int]]):
        self.runs = runs
        listed = ", ".join(f"run {r} ({status}, version {v})" for r, status, v in runs[:5])
        more = f" and {len(runs) - 5} more" if len(runs) > 5 else ""
        super().__init__(f"dataset {name!r} is in use by {listed}{more}; stop those runs or wait for them to "
                         "finish, or delete only versions no live run pins (`version=`)")


@dataclass
class LoadedDataset:
    """Rows of one version of (name, split) in index order."""

    name: str
    split: str
    rows: list[dict[str, Any]]
    task_ids: list[str] = field(default_factory=list)
    info: dict[str, Any] = field(default_factory=dict)
    version: int = 1

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict[str, Any]:
        return self.rows[i]

    def repeat(self, n: int) -> LoadedDataset:
        """Each row n times in a row (rLLM's `repeat`), e.g. for pass@k evaluation without sample indices."""
        if n < 1:
            raise DatasetError(f"repeat(n) needs n >= 1, got {n}")
        rows = [r for r in self.rows for _ in range(n)]
        ids = [t for t in self.task_ids for _ in range(n)]
        return LoadedDataset(self.name, self.split, rows, ids, dict(self.info), self.version)


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


class DatasetCatalog:
    """Reading datasets in Postgres. Synchronous (SQLAlchemy Engine); the API calls it from a worker thread."""

    def __init__(self, engine: Engine):
        self.engine = engine

    def describe(self, name: str, split: str = "train", version: int | None = None) -> dict[str, Any]:
        with self.engine.connect() as conn:
            return _describe(find_version(conn, name, split, version))

    def load(self, name: str, split: str = "train", version: int | None = None, *, offset: int = 0,
             limit: int | None = None) -> LoadedDataset:
        """Rows of one version (default: the latest) in index order."""
        with self.engine.connect() as conn:
            ds = find_version(conn, name, split, version)
            q = (select(DatasetRow.task_id, DatasetRow.data).where(DatasetRow.dataset_id == ds.id)
                 .order_by(DatasetRow.idx).offset(offset).limit(limit))
            rows = conn.execute(q).all()
        return LoadedDataset(name, split, [r.data for r in rows], [r.task_id for r in rows], dict(ds.info), ds.version)

    def exists(self, name: str, split: str | None = None) -> bool:
        splits = self.splits(name)
        return bool(splits) if split is None else split in splits

    def splits(self, name: str) -> list[str]:
        with self.engine.connect() as conn:
            q = select(Dataset.split).where(Dataset.name == name).distinct().order_by(Dataset.split)
            return list(conn.execute(q).scalars())

    def versions(self, name: str, split: str = "train") -> list[dict[str, Any]]:
        """Every version of (name, split), oldest first."""
        with self.engine.connect() as conn:
            q = (select(Dataset).where(Dataset.name == name, Dataset.split == split)
                 .order_by(Dataset.version))
            return [_describe(d) for d in conn.execute(q)]

    def list(self) -> list[dict[str, Any]]:
        """The latest version of every (name, split), with the numbers of all its versions."""
        with self.engine.connect() as conn:
            all_versions = conn.execute(select(Dataset).order_by(
                Dataset.name, Dataset.split, Dataset.version)).all()
        latest: dict[tuple[str, str], dict[str, Any]] = {}
        for d in all_versions:
            numbers = latest.get((d.name, d.split), {}).get("versions", [])
            latest[(d.name, d.split)] = _describe(d) | {"versions": [*numbers, d.version]}
        return list(latest.values())

class DatasetRegistry(DatasetCatalog):
    """Reading, adding and deleting versions. The jobs worker is the one service that writes datasets (the API's
    uploads and deletes are jobs); the API reads through `DatasetCatalog`."""

    def register(
        self, name: str, rows: list[Any], split: str = "train", *, source: str = "", info: dict | None = None
    ) -> dict[str, Any]:
        """Validate and store rows as the next version of (name, split), in one transaction."""
        validate_name(name)
        validate_name(split, "split")
        clean = validate_rows(list(rows))
        with self.engine.begin() as conn:
            # Concurrent imports of one (name, split) take turns, so each gets its own version number.
            conn.execute(select(func.pg_advisory_xact_lock(func.hashtext(f"dataset:{name}/{split}"))))
            latest = conn.execute(select(func.max(Dataset.version)).where(
                Dataset.name == name, Dataset.split == split)).scalar()
            ds_id = conn.execute(
                insert(Dataset)
                .values(name=name, split=split, version=(latest or 0) + 1, source=source, num_rows=len(clean),
                        info=info or {})
                .returning(Dataset.id)
            ).scalar_one()
            records = [
                {"dataset_id": ds_id, "idx": i, "task_id": task_id_of(r, i), "data": r,
                 "data_source": str(r.get("data_source", ""))[:200]}
                for i, r in enumerate(clean)
            ]
            for start in range(0, len(records), _INSERT_CHUNK):
                conn.execute(insert(DatasetRow), records[start:start + _INSERT_CHUNK])
        return self.describe(name, split, (latest or 0) + 1)

    def delete(self, name: str, split: str | None = None, version: int | None = None) -> int:
        """Delete one version, one split (every version) or the whole dataset; returns how many versions went.
        Refused (DatasetInUse) while a run that has not ended pins any of them. Rows cascade."""
        q = select(Dataset.id, Dataset.split, Dataset.version).where(Dataset.name == name)
        if split is not None:
            q = q.where(Dataset.split == split)
        if version is not None:
            q = q.where(Dataset.version == version)
        with self.engine.begin() as conn:
            # Row locks: a run being created pins its version FOR SHARE (find_version(lock=True)), so it
            # either commits first (and is seen below) or waits and finds the version gone.
            doomed = conn.execute(q.with_for_update()).all()
            if not doomed:
                what = f"dataset {name!r}" + (f" split {split!r}" if split else "")
                raise DatasetNotFound(what + (f" version {version}" if version else "") + " does not exist")
            users = runs_using(conn, name, {(d.split, d.version) for d in doomed})
            if users:
                raise DatasetInUse(name, users)
            conn.execute(delete(Dataset).where(Dataset.id.in_([d.id for d in doomed])))
        return len(doomed)


def find_version(conn: Connection, name: str, split: str, version: int | None = None, *, lock: bool = False) -> Any:
    """The `datasets` row of one version (default: the latest); DatasetNotFound names what exists. `lock` holds
    it FOR SHARE until the transaction ends, so it cannot be deleted under a run being created."""
    q = select(Dataset).where(Dataset.name == name, Dataset.split == split)
    q = q.where(Dataset.version == version) if version is not None else q.order_by(Dataset.version.desc())
    row = conn.execute((q.with_for_update(read=True) if lock else q).limit(1)).first()
    if row is None:
        known = conn.execute(select(Dataset.split, Dataset.version).where(Dataset.name == name)
                             .order_by(Dataset.split, Dataset.version)).all()
        wanted = f"split {split!r}" + (f" version {version}" if version is not None else "")
        if known:
            registered = ", ".join(f"{s} v{v}" for s, v in known)
            raise DatasetNotFound(f"dataset {name!r} has no {wanted}; it has: {registered}")
        raise DatasetNotFound(f"no dataset named {name!r}; {_other_datasets(conn, name)}")
    return row  # a Core row: columns by attribute (id, name, split, version, ...)


def _other_datasets(conn: Connection, name: str) -> str:
    """What exists instead of `name`: the closest name first, then every dataset (name/split)."""
    pairs = conn.execute(select(Dataset.name, Dataset.split).distinct()
                         .order_by(Dataset.name, Dataset.split)).all()
    if not pairs:
        return "no dataset exists yet"
    close = difflib.get_close_matches(name, sorted({n for n, _ in pairs}), n=1, cutoff=0.5)
    listed = ", ".join(f"{n}/{s}" for n, s in pairs[:50]) + (f" (and {len(pairs) - 50} more)" if len(pairs) > 50 else "")
    return (f"did you mean {close[0]!r}? " if close else "") + f"datasets (name/split): {listed}"


def runs_using(conn: Connection, name: str, versions: set[tuple[str, int]]) -> list[tuple[str, str, int]]:
    """(run id, status, version) of runs not yet ended that read one of these (split, version)s of `name`.
    A run whose config names no version reads the latest one."""
    r, d, other = Run, Dataset, aliased(Dataset)
    latest = select(func.max(other.version)).where(other.name == d.name, other.split == d.split).scalar_subquery()
    pinned = func.coalesce(cast(r.config["dataset_version"].astext, Integer), latest)
    reads = and_(d.name == r.config["dataset"].astext,
                 d.split == func.coalesce(r.config["dataset_split"].astext, "train"), d.version == pinned)
    rows = conn.execute(select(cast(r.id, Text), r.status, d.split, d.version).join(d, reads)
                        .where(d.name == name, r.status.not_in(TERMINAL_RUN_STATUSES)).order_by(r.created_at)).all()
    return [(r[0], r[1], r[3]) for r in rows if (r[2], r[3]) in versions]


def _describe(ds: Any) -> dict[str, Any]:
    return {
        "id": str(ds.id), "name": ds.name, "split": ds.split, "version": ds.version, "source": ds.source,
        "num_rows": ds.num_rows, "info": ds.info, "created_at": ds.created_at.isoformat() if ds.created_at else None,
    }


def pin_version(conn: Connection, name: str, split: str, version: int | None = None) -> tuple[int, int]:
    """(version, rows) a new run will read: the given version or the latest, locked until the caller's
    transaction commits (so a concurrent delete sees the run). Raises DatasetNotFound."""
    ds = find_version(conn, name, split, version, lock=True)
    return ds.version, ds.num_rows


def count_rows(engine: Engine, name: str, split: str, version: int | None = None) -> int | None:
    """Rows in one version (default: the latest) of (name, split), or None when it does not exist."""
    try:
        with engine.connect() as conn:
            return find_version(conn, name, split, version).num_rows
    except DatasetNotFound:
        return None
