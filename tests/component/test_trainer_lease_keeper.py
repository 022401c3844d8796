"""The trainer keeps its leases through torch work longer than the lease TTL (Trainer._in_torch), over a real
Postgres: a run it trains and a Tinker model it holds are still its own after work three TTLs long, where another
trainer of the fleet would otherwise have taken them over as a dead trainer's."""

from __future__ import annotations

import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import pytest
from sqlalchemy import insert

from services.trainer.loop import Trainer
from shared.contracts.db.models import Run
from shared.platform import leases
from shared.platform.db.session import make_engine

TTL_S = 1.5


@pytest.fixture
def engine(database_url):
    eng = make_engine(database_url)
    yield eng
    eng.dispose()


def busy_trainer(engine, run_id: str, tinker_run_id: str) -> Trainer:
    trainer = object.__new__(Trainer)  # what _in_torch reads: its leases, its torch thread, the lease TTL
    trainer.db, trainer.worker_id, trainer.settings = engine, "trainer-busy", SimpleNamespace(lease_ttl_s=TTL_S)
    trainer.runs, trainer.tinker = {run_id: None}, SimpleNamespace(held={"s:train:0": (tinker_run_id, None)})
    trainer.torch_thread = ThreadPoolExecutor(1)
    return trainer


def acquire(engine, owner: str, run_ids: list[str]) -> set[str]:
    with engine.begin() as c:
        return leases.acquire(c, leases.TRAINER, owner, run_ids, TTL_S)


async def test_leases_are_renewed_while_torch_work_outlasts_them(engine):
    ids = [uuid.uuid4(), uuid.uuid4()]
    with engine.begin() as c:
        c.execute(insert(Run), [dict(id=ids[0], name="keeper", kind="train", status="running", config={}),
                                dict(id=ids[1], name="keeper", kind="tinker", status="running", config={})])
    run_id, tinker_run_id = map(str, ids)
    trainer = busy_trainer(engine, run_id, tinker_run_id)
    assert acquire(engine, "trainer-busy", [run_id, tinker_run_id]) == {run_id, tinker_run_id}
    try:
        assert await trainer._in_torch(lambda: time.sleep(3 * TTL_S) or "done") == "done"
        assert acquire(engine, "trainer-other", [run_id, tinker_run_id]) == set()  # still the busy trainer's
        time.sleep(TTL_S + 0.5)  # idle, nothing renews them: they lapse
        assert acquire(engine, "trainer-other", [run_id, tinker_run_id]) == {run_id, tinker_run_id}
    finally:
        trainer.torch_thread.shutdown()
