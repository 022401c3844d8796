"""One unit's trace across the real services' code, in one process over real Redis and Postgres, exported to
the SDK's in-memory exporter: the controller's dispatch (DispatchLoop.insert_tasks), a rollout worker and an
env worker running the task on a tiny HF model, the store (IngestLoop), and the trainer's step (maybe_step,
the learner stubbed). Each hop's traceparent crosses a real stream entry; the unit's spans form one tree
with the right parents, and the training step links to each unit it trained on. And a service process with
OTEL_EXPORTER_OTLP_ENDPOINT set exports its spans over OTLP/HTTP, continuing the trace a message carried."""

from __future__ import annotations

import asyncio
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from fixtures.aio import cancel_and_wait
from fixtures.rollout_stack import insert_run, run_config
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from sqlalchemy import select

from services.controller.dispatch import DispatchLoop
from services.controller.ingest import IngestLoop
from services.controller.run_driver import RunDriver
from services.controller.run_rows import RunRow
from services.controller.settings import ControllerSettings
from services.env_worker.settings import EnvWorkerSettings
from services.env_worker.worker import EnvWorker
from services.rollout_worker.settings import RolloutWorkerSettings
from services.rollout_worker.worker import RolloutWorker
from services.trainer import batch as batching
from services.trainer.loop import RunState, Trainer
from shared.contracts.db.models import EpisodeRow
from shared.contracts.messages import AcceptedResult, EnvRequest, decode, encode
from shared.contracts.streams import ACCEPTED_RESULTS, ENV_REQUESTS, ROLLOUT_TASKS
from shared.platform import tracing
from shared.platform.bus import Delivery, StreamBus, connect
from shared.platform.db.session import make_engine
from tests.support.procs import start_service, stop, wait_heartbeat
from tests.support.tiny_model import build_tiny_model

ROW = {"id": "t1", "question": "What is 2 + 2?", "ground_truth": "4"}


@pytest.fixture
def spans():
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracing.install(provider)
    yield exporter
    tracing.install(None)
    provider.shutdown()


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return str(build_tiny_model(tmp_path_factory.mktemp("tiny") / "model", seed=0))


@pytest.mark.timeout(300)
async def test_one_units_spans_form_one_tree_across_the_services(spans, isolated_urls, model_path, tmp_path):
    redis_url, database_url = isolated_urls
    config = run_config(model_path, kind="train", samples_per_task=2, tasks_per_batch=1, max_in_flight=2)
    run_id = insert_run(database_url, config)
    redis, db = connect(redis_url), make_engine(database_url)
    bus, stop = StreamBus(redis), asyncio.Event()
    rollout = RolloutWorker(RolloutWorkerSettings(redis_url=redis_url, database_url=database_url,
                                                  data_dir=tmp_path), "rollout-t", redis, db)
    env = EnvWorker(EnvWorkerSettings(redis_url=redis_url), "env-t", redis)
    ingest = IngestLoop(ControllerSettings(redis_url=redis_url, database_url=database_url), "ctl-t", db, bus, {},
                        asyncio.Event())
    await rollout.start()
    loops = [asyncio.create_task(c) for c in [*rollout.loops(stop), *env.loops(stop), ingest.run(stop)]]
    try:
        # the controller's dispatch: ledger rows, then the tasks on `rollout.tasks`
        driver = RunDriver(RunRow(run_id, "running", config.model_dump(mode="json"), 0), config,
                           [(ROW["id"], ROW, "test")])
        dispatch = DispatchLoop(ControllerSettings(), "ctl-t", db, bus, {}, asyncio.Event(), {})
        with db.begin() as conn:
            tasks = dispatch.insert_tasks(conn, driver)
        assert len(tasks) == 2 and all(t.traceparent for t in tasks)
        await bus.publish_many(ROLLOUT_TASKS, tasks)
        accepted = await read_accepted(redis, run_id, expected=2)
    finally:
        stop.set()
        await asyncio.wait(loops, timeout=30)
        await cancel_and_wait(*loops)
        await rollout.close()
        await env.close()
        await redis.aclose()

    # the trainer: the accepted results held, then its real maybe_step (the learner itself stubbed)
    trainer = Trainer.__new__(Trainer)
    stepped: list[str] = []

    async def step(run, groups):
        stepped.append(tracing.traceparent())

    trainer.step = step
    run = RunState(run_id, config, 0, None, None, None, batching.GroupBuffer(2, need_greedy=False))
    for entry_id, msg in accepted:
        run.held[(run_id, msg.task_id, msg.sample_idx)] = Delivery(id=entry_id, message=msg, deliveries=1, fields={})
        for sample in batching.samples_from_result(msg.result):
            run.buffer.add(sample)
    await trainer.maybe_step(run)
    assert len(stepped) == 1

    finished = spans.get_finished_spans()
    by_id = {s.context.span_id: s for s in finished}
    step_span = next(s for s in finished if s.name == "train.step")
    assert step_span.parent is None and step_span.attributes["policy_version"] == 1
    linked = {lk.context.span_id for lk in step_span.links}
    with db.connect() as conn:
        infos = {r.sample_idx: r.info for r in conn.execute(select(EpisodeRow.sample_idx, EpisodeRow.info)
                                                              .where(EpisodeRow.run_id == uuid.UUID(run_id)))}
    for task in tasks:
        trace_id = tracing.trace_id(task.traceparent)
        unit = [s for s in finished if format(s.context.trace_id, "032x") == trace_id]
        names = sorted(s.name for s in unit)
        assert names == ["dispatch", "env.reset", "env.serve.reset", "env.serve.step", "env.step", "generate",
                         "queue", "rollout", "store"], names
        one = {s.name: s for s in unit}
        # one tree: a single root, every other span's parent in the same trace
        assert [s.name for s in unit if s.parent is None] == ["dispatch"]
        assert all(s.parent.span_id in by_id for s in unit if s.parent is not None)
        parent = {s.name: by_id[s.parent.span_id].name for s in unit if s.parent is not None}
        assert parent == {"queue": "dispatch", "rollout": "dispatch", "env.reset": "rollout", "generate": "rollout",
                          "env.step": "rollout", "env.serve.reset": "env.reset", "env.serve.step": "env.step",
                          "store": "rollout"}
        assert one["dispatch"].attributes["sample_idx"] == task.sample_idx
        assert one["rollout"].attributes["queue_wait_ms"] >= 0
        assert one["generate"].attributes["weight_version"] == 0 and one["generate"].attributes["tokens"] > 0
        assert one["store"].attributes["accepted"] is True
        assert one["store"].context.span_id in linked  # the training step that consumed this unit
        assert infos[task.sample_idx]["trace_id"] == trace_id  # SQL finds the unit's trace


async def read_accepted(redis, run_id: str, expected: int, timeout_s: float = 180.0) -> list:
    out, cursor, deadline = [], "0-0", time.monotonic() + timeout_s
    while len(out) < expected and time.monotonic() < deadline:
        for _, entries in await redis.xread({ACCEPTED_RESULTS: cursor}, count=10, block=500) or []:
            for entry_id, fields in entries:
                cursor = entry_id
                msg = decode(fields, AcceptedResult)
                if msg.run_id == run_id and msg.result is not None:
                    out.append((entry_id, msg))
    assert len(out) == expected, f"{len(out)} of {expected} results accepted in {timeout_s}s"
    return out



class Collector(BaseHTTPRequestHandler):
    """An OTLP/HTTP trace receiver: keeps (service.name, span name, trace id hex, parent span id hex)."""

    received: list[tuple[str, str, str, str]] = []

    def do_POST(self):  # noqa: N802 (http.server's name)
        from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

        body = ExportTraceServiceRequest()
        body.ParseFromString(self.rfile.read(int(self.headers["Content-Length"])))
        for rs in body.resource_spans:
            service = next(a.value.string_value for a in rs.resource.attributes if a.key == "service.name")
            for ss in rs.scope_spans:
                self.received += [(service, s.name, s.trace_id.hex(), s.parent_span_id.hex()) for s in ss.spans]
        self.send_response(200)
        self.send_header("Content-Type", "application/x-protobuf")
        self.end_headers()

    def log_message(self, *args):
        pass


@pytest.mark.timeout(120)
async def test_a_service_with_an_endpoint_exports_its_spans_over_otlp(redis_url):
    server = ThreadingHTTPServer(("127.0.0.1", 0), Collector)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    worker_id = f"env-otlp-{uuid.uuid4().hex[:6]}"
    proc = start_service("services.env_worker.main", redis_url=redis_url, worker_id=worker_id,
                         otel_exporter_otlp_endpoint=f"http://127.0.0.1:{server.server_port}",
                         otel_bsp_schedule_delay="100")  # the SDK's batch delay, ms: export at once
    redis = connect(redis_url)
    try:
        wait_heartbeat(redis_url, "env-worker", worker_id, proc)
        trace_id, parent = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
        req = EnvRequest(request_id=uuid.uuid4().hex, op="reset", session_id=uuid.uuid4().hex, run_id="r1",
                         env="math", task={"question": "What is 2 + 2?", "ground_truth": "4"}, reply_to="",
                         sent_at=time.time(), traceparent=f"00-{trace_id}-{parent}-01")
        await redis.xadd(ENV_REQUESTS, encode(req))
        deadline = time.monotonic() + 60
        while not Collector.received and time.monotonic() < deadline:
            await asyncio.sleep(0.2)
    finally:
        await redis.aclose()
        stop(proc)
        server.shutdown()
    assert ("env-worker", "env.serve.reset", trace_id, parent) in Collector.received, Collector.received
