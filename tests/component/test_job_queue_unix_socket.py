"""One REDIS_URL for every component, however it is started: with a unix-socket Redis (`unix:///...?db=N`, what the
embedded Redis of the local stack gives), the jobs service's intake enqueues and its Celery worker reads the
job, each from REDIS_URL alone (kombu rejects redis-py's `unix://` spelling; services.jobs.celery_app.
celery_broker_url translates it where Celery is configured). Against a real redis-server listening on a unix socket only.

    pytest -q tests/component/test_job_queue_unix_socket.py
"""

from __future__ import annotations

import pytest

from infra.local.servers import RedisServer
from services.jobs.celery_app import celery_broker_url, celery_client, make_celery
from services.jobs.settings import JobsSettings
from shared.clients.jobs import JOB_TASKS
from shared.platform.bus import connect_sync


def test_celery_broker_url_translates_unix_sockets_only():
    assert celery_broker_url("unix:///tmp/x/redis.socket?db=3") == "redis+socket:///tmp/x/redis.socket?virtual_host=3"
    assert celery_broker_url("unix:///tmp/r.sock") == "redis+socket:///tmp/r.sock?virtual_host=0"
    assert celery_broker_url("redis://127.0.0.1:6379/2") == "redis://127.0.0.1:6379/2"


@pytest.fixture(scope="module")
def unix_redis_url(tmp_path_factory):
    server = RedisServer(tmp_path_factory.mktemp("unix-redis"), unix_socket=True)
    server.start()
    yield server.url.replace("?db=0", "?db=2")  # not db 0: the translation must keep the database
    server.stop()


def test_the_intake_enqueues_and_the_jobs_worker_reads_over_a_unix_socket(unix_redis_url, monkeypatch):
    monkeypatch.delenv("CELERY_BROKER_URL", raising=False)  # Celery would prefer it over the app's broker
    assert unix_redis_url.startswith("unix://")
    celery_client(unix_redis_url).send_task(JOB_TASKS["gc"], args=["job-1"], task_id="job-1")
    assert connect_sync(unix_redis_url).llen("celery") == 1  # on the socket, in the URL's database

    worker = make_celery(JobsSettings(redis_url=unix_redis_url, database_url="postgresql+psycopg://nobody@127.0.0.1/x"))
    with worker.connection_for_read() as conn:
        queue = conn.SimpleQueue("celery")
        message = queue.get(timeout=10)
        assert (message.headers["task"], message.headers["id"]) == (JOB_TASKS["gc"], "job-1")
        message.ack()
        queue.close()
    assert connect_sync(unix_redis_url).llen("celery") == 0
