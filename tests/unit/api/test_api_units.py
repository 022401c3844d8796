"""Pure pieces of the control plane: dataset row validation and loaders, token scopes, expected work."""

from __future__ import annotations

import io

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from services.api.auth import Principal, hash_token, new_token
from services.api.progress import expected_samples
from services.api.routers.sql import FORBIDDEN, _cell
from shared.datasets import Dataset, DatasetError, detect_format, rows_from_bytes, task_id_of, validate_rows


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
    ds = Dataset("d", "train", [{"a": 1}, {"a": 2}], ["0", "1"]).repeat(3)
    assert len(ds) == 6 and ds.task_ids == ["0", "0", "0", "1", "1", "1"]


def test_scopes_nest():
    admin, write, read = (Principal("x", frozenset({s})) for s in ("admin", "write", "read"))
    assert admin.can("admin") and admin.can("read")
    assert write.can("read") and write.can("write") and not write.can("admin")
    assert read.can("read") and not read.can("write")
    assert not Principal("x", frozenset({"bogus"})).can("read")
    token = new_token()
    assert token.startswith("fw_") and len(hash_token(token)) == 64 and hash_token(token) != hash_token(new_token())


def test_expected_samples():
    assert expected_samples({"kind": "eval", "samples_per_task": 4, "tasks_per_batch": 8}, 10) == 40
    assert expected_samples({"kind": "eval", "samples_per_task": 4, "max_tasks": 3}, 10) == 12
    assert expected_samples({"kind": "train", "samples_per_task": 2, "tasks_per_batch": 8, "total_steps": 5}, 99) == 80
    assert expected_samples({"kind": "train", "samples_per_task": 2, "epochs": 2}, 10) == 40
    assert expected_samples({"kind": "eval"}, None) is None


def test_sql_guard_and_cells():
    assert FORBIDDEN.search("SET ROLE postgres") and FORBIDDEN.search("select set_config('role','x',true)")
    assert not FORBIDDEN.search("select * from settings_table")
    assert _cell(float("nan")) == "nan" and _cell(b"\x00\x01") == "AAE=" and _cell({"a": [1.5]}) == {"a": [1.5]}
