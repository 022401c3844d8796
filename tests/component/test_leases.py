"""shared/platform/leases.py over a real Postgres: one owner per run in each lease table, expiry, takeover, release."""

from __future__ import annotations

import threading
import time
import uuid

import pytest
from sqlalchemy import insert

from shared.contracts.db.models import Run
from shared.platform import leases
from shared.platform.db.session import make_engine


@pytest.fixture(scope="module")
def engine(database_url):
    eng = make_engine(database_url, pool_size=16)
    yield eng
    eng.dispose()


def new_runs(engine, n: int) -> list[str]:
    ids = [uuid.uuid4() for _ in range(n)]
    with engine.begin() as c:
        c.execute(insert(Run), [dict(id=i, name="lease", kind="train", status="running", config={}) for i in ids])
    return [str(i) for i in ids]


def acquire(engine, owner: str, run_ids, ttl_s: float = 10.0, role: str = leases.TRAINER) -> set[str]:
    with engine.begin() as c:
        return leases.acquire(c, role, owner, run_ids, ttl_s)


def test_a_held_lease_is_renewed_by_its_owner_and_refused_to_others(engine):
    a, b = new_runs(engine, 2)
    assert acquire(engine, "t1", [a]) == {a}
    assert acquire(engine, "t2", [a, b]) == {b}  # a is t1's
    assert acquire(engine, "t1", [a, b]) == {a}  # renewed; b is t2's
    # roles are independent: the run's controller lease is not its trainer lease
    assert acquire(engine, "c1", [a, b], role=leases.CONTROLLER) == {a, b}


def test_an_expired_lease_is_taken_over_and_the_old_owner_loses_it(engine):
    (run,) = new_runs(engine, 1)
    assert acquire(engine, "old", [run], ttl_s=0.3) == {run}
    assert acquire(engine, "new", [run]) == set()
    time.sleep(0.5)  # "old" stopped renewing
    assert acquire(engine, "new", [run]) == {run}
    assert acquire(engine, "old", [run]) == set()  # its next renewal tells it to drop the run


def test_release_hands_the_run_over_at_once(engine):
    a, b = new_runs(engine, 2)
    assert acquire(engine, "t1", [a, b]) == {a, b}
    with engine.begin() as c:
        leases.release(c, leases.TRAINER, "t1", [a])
    assert acquire(engine, "t2", [a, b]) == {a}
    with engine.begin() as c:
        leases.release(c, leases.TRAINER, "t1")
    assert acquire(engine, "t2", [a, b]) == {a, b}


def test_free_or_ours_lists_ours_first(engine):
    a, b, c = new_runs(engine, 3)
    acquire(engine, "x", [b])
    acquire(engine, "y", [c])
    with engine.begin() as conn:
        assert leases.free_or_ours(conn, leases.TRAINER, "y", [a, b, c]) == [c, a]


def test_many_contenders_never_make_two_owners(engine):
    """Processes racing for the same runs, again and again as leases expire: at every round each run has
    exactly one winner."""
    runs = new_runs(engine, 4)
    for _ in range(5):
        won: dict[str, set[str]] = {}
        barrier = threading.Barrier(8)

        def contend(owner: str, won: dict = won, barrier: threading.Barrier = barrier) -> None:
            barrier.wait()
            won[owner] = acquire(engine, owner, runs, ttl_s=0.2)

        threads = [threading.Thread(target=contend, args=(f"p{i}-{uuid.uuid4().hex[:4]}",)) for i in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        owners = [run for held in won.values() for run in held]
        assert sorted(owners) == sorted(runs), won  # every run taken, none twice
        time.sleep(0.3)  # all expire: the next round starts free
