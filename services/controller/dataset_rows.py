"""A run's pinned dataset version (`datasets`, `dataset_rows`; versions are immutable): the tasks it dispatches,
and the data source of each sample an eval run scored (pass@k per source).
"""

from __future__ import annotations

from sqlalchemy import Connection, func, select

from shared.contracts.db.models import Dataset, DatasetRow, EpisodeRow


def load_tasks(conn: Connection, name: str, split: str, version: int | None,
               limit: int | None) -> list[tuple[str, dict, str]]:
    """(task_id, data, data_source) of the run's pinned dataset version (None: the latest) in row order; raises
    ValueError when it is missing. Versions are immutable, so a rebuilt plan reads the rows the run started with."""
    found = conn.execute(_dataset_version(name, split, version)).scalar()
    if found is None:
        which = f" version {version}" if version is not None else ""
        raise ValueError(f"dataset {name!r} split {split!r}{which} is not registered; register it "
                         "(POST /v1/datasets) or fix `dataset` / `dataset_split` / `dataset_version` in the run config")
    rows = conn.execute(select(DatasetRow.task_id, DatasetRow.data, DatasetRow.data_source)
                        .where(DatasetRow.dataset_id == found).order_by(DatasetRow.idx).limit(limit)).all()
    ids = [r[0] for r in rows]
    if len(set(ids)) != len(ids):
        raise ValueError(f"dataset {name!r} split {split!r} has duplicate task ids; give each row a unique "
                         "'task_id' or 'id' field")
    return [tuple(r) for r in rows]


def _dataset_version(name: str, split: str, version: int | None):
    """The id of a dataset's version (None: the latest), as a query."""
    query = select(Dataset.id).where(Dataset.name == name, Dataset.split == split)
    if version is not None:
        query = query.where(Dataset.version == version)
    return query.order_by(Dataset.version.desc()).limit(1)


def eval_samples(conn: Connection, run_id: str, name: str, split: str,
                 version: int | None) -> list[tuple[str, str, bool]]:
    """(task_id, data_source, is_correct) of every stored completed sample of an eval run (data_source from the
    run's dataset version; None: the latest)."""
    rows = select(DatasetRow.task_id, DatasetRow.data_source) \
        .where(DatasetRow.dataset_id == _dataset_version(name, split, version).scalar_subquery()).subquery()
    e = EpisodeRow
    return [tuple(r) for r in conn.execute(
        select(e.task_id, func.coalesce(rows.c.data_source, ""), e.is_correct)
        .outerjoin(rows, rows.c.task_id == e.task_id).where(e.run_id == run_id, e.status == "completed")).all()]
