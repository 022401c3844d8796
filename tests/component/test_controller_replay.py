"""The controller's replay after Redis lost its data, in process against real Redis: the epoch key becomes done
only when a whole replay ran with nothing wiping Redis again meanwhile."""

from __future__ import annotations

import redis

from services.controller import reconcile
from services.controller.reconcile import ReconcileLoop
from services.controller.settings import ControllerSettings
from shared.contracts.messages import AcceptedResult, decode
from shared.contracts.streams import ACCEPTED_RESULTS, epoch_key
from shared.platform.bus import StreamBus


class FlushingReplay(ReconcileLoop):
    """A replay whose Postgres side is one run with one unread group; Redis loses its data while the first
    replay reads it (as another flush would while a replay reads many runs)."""

    def __init__(self, redis_url: str, bus: StreamBus):
        super().__init__(ControllerSettings(redis_url=redis_url), "ctl-test", None, bus)
        self.redis_url, self.reads = redis_url, 0

    def unconsumed(self, run_id: str) -> list[AcceptedResult]:
        self.reads += 1
        if self.reads == 1:
            redis.Redis.from_url(self.redis_url).flushdb()
        return [AcceptedResult(run_id=run_id, task_id="t0", sample_idx=s, attempt=0, batch_idx=0, greedy=False)
                for s in range(2)]


async def test_redis_losing_its_data_during_a_replay_is_replayed_again(redis_url, redis_client, monkeypatch):
    monkeypatch.setattr(reconcile.run_rows, "active_train_runs", lambda db: ["run-a"])
    loop = FlushingReplay(redis_url, StreamBus(redis_client))

    async def replayed() -> list[tuple[str, int]]:
        return sorted((m.task_id, m.sample_idx) for _, f in await redis_client.xrange(ACCEPTED_RESULTS)
                      if (m := decode(f)))

    await loop.replay_if_redis_lost()  # the flush wiped the key mid-replay (and whatever it had sent): not done
    assert await redis_client.get(epoch_key()) is None
    await loop.replay_if_redis_lost()  # replays again, and this time it is done
    assert await replayed() == [("t0", 0), ("t0", 0), ("t0", 1), ("t0", 1)]  # duplicates are harmless
    assert await redis_client.get(epoch_key()) == b"ctl-test"
    await loop.replay_if_redis_lost()  # done: nothing more
    assert (loop.reads, len(await replayed())) == (2, 4)


async def test_a_replay_left_unfinished_is_taken_up_again(redis_url, redis_client, monkeypatch):
    """A controller that crashed mid-replay left `replaying:`: the next pass (its own or another controller's)
    replays in full."""
    monkeypatch.setattr(reconcile.run_rows, "active_train_runs", lambda db: ["run-a"])
    loop = FlushingReplay(redis_url, StreamBus(redis_client))
    loop.reads = 1  # no flush
    await redis_client.set(epoch_key(), reconcile.REPLAYING + b"ctl-dead:1")
    await loop.replay_if_redis_lost()
    assert len(await redis_client.xrange(ACCEPTED_RESULTS)) == 2
    assert await redis_client.get(epoch_key()) == b"ctl-test"
