"""Pure pieces of the control plane: dataset row validation and loaders, token scopes, expected work."""

from __future__ import annotations

import io

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from services.api.auth import Principal, hash_token, new_token
from services.api.progress import planned_units, progress
from services.api.routers.sql import FORBIDDEN, _cell
from shared.stores.datasets import (
    DatasetError,
    LoadedDataset,
    detect_format,
    rows_from_bytes,
    task_id_of,
    validate_rows,
)


def test_validate_rows_explains_what_is_wrong():
    with pytest.raises(DatasetError, match="no rows"):
        validate_rows([])
    with pytest.raises(DatasetError, match="row 1: expected a JSON object"):
        validate_rows([{"a": 1}, [1]])
    with pytest.raises(DatasetError, match="row 2: duplicate task id 'a'"):
        validate_rows([{"id": "a"}, {"id": "b"}, {"task_id": "a"}])
    assert validate_rows([{"x": float("nan")}]) == [{"x": None}]  # JSONB refuses NaN


def test_task_id_rule():
    assert task_id_of({"task_id": 7, "id": 3}, 0) == "7"
    assert task_id_of({"id": 3}, 0) == "3"
    assert task_id_of({"q": 1}, 5) == "5"


def test_loaders():
    assert rows_from_bytes(b'{"a": 1}\n\n{"a": 2}\n', "jsonl") == [{"a": 1}, {"a": 2}]
    assert rows_from_bytes(b"a,b\n1,2\n", "csv") == [{"a": "1", "b": "2"}]
    buf = io.BytesIO()
    pq.write_table(pa.Table.from_pylist([{"a": 1}]), buf)
    assert rows_from_bytes(buf.getvalue(), "parquet") == [{"a": 1}]
    with pytest.raises(DatasetError, match="line 1: not valid JSON"):
        rows_from_bytes(b"{bad", "jsonl")
    with pytest.raises(DatasetError, match="parquet"):
        rows_from_bytes(b"not parquet", "parquet")
    assert detect_format("x.PARQUET") == "parquet"
    with pytest.raises(DatasetError, match="unknown format"):
        detect_format("x.xlsx")


def test_repeat():
    ds = LoadedDataset("d", "train", [{"a": 1}, {"a": 2}], ["0", "1"]).repeat(3)
    assert len(ds) == 6 and ds.task_ids == ["0", "0", "0", "1", "1", "1"]


def test_scopes_nest():
    admin, write, read = (Principal("x", frozenset({s})) for s in ("admin", "write", "read"))
    assert admin.can("admin") and admin.can("read")
    assert write.can("read") and write.can("write") and not write.can("admin")
    assert read.can("read") and not read.can("write")
    assert not Principal("x", frozenset({"bogus"})).can("read")
    token = new_token()
    assert token.startswith("fw_") and len(hash_token(token)) == 64 and hash_token(token) != hash_token(new_token())


def test_planned_units():
    assert planned_units({"kind": "eval", "samples_per_task": 4, "tasks_per_batch": 8}, 10) == 40
    assert planned_units({"kind": "eval", "samples_per_task": 4, "max_tasks": 3}, 10) == 12
    assert planned_units({"kind": "train", "samples_per_task": 2, "epochs": 2}, 10) == 40
    assert planned_units({"kind": "eval"}, None) is None


def test_progress_never_passes_its_total():
    """A training run with total_steps counts steps; replacement groups never push samples past the plan
    (the old `runs show` printed "trajectories 360/320")."""
    class FakeRun:
        kind, policy_version, config = "train", 3, {"total_steps": 5, "samples_per_task": 2}

    assert progress(FakeRun, {"completed": 360, "failed": 0}, 20) == {"unit": "steps", "done": 3, "total": 5,
                                                                      "fraction": 0.6}
    FakeRun.config = {"samples_per_task": 16, "epochs": 1}
    assert progress(FakeRun, {"completed": 330, "failed": 30}, 20)["done"] == 320
    FakeRun.kind = "eval"
    assert progress(FakeRun, {"completed": 100, "failed": 4}, 20) == {"unit": "samples", "done": 104,
                                                                     "total": 320, "fraction": 104 / 320}
    assert progress(FakeRun, {"completed": 100, "errored": 6, "failed": 4}, 20)["done"] == 110  # errored: finished


def test_sql_guard_and_cells():
    assert FORBIDDEN.search("SET ROLE postgres") and FORBIDDEN.search("select set_config('role','x',true)")
    assert not FORBIDDEN.search("select * from settings_table")
    assert _cell(float("nan")) == "nan" and _cell(b"\x00\x01") == "AAE=" and _cell({"a": [1.5]}) == {"a": [1.5]}
