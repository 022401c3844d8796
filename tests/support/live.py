"""Driving and judging a live flywheel system, shared by the benchmarks (tests/support/chaos.py, load.py, train.py,
vllm.py) and the system tests (tests/e2e/test_fuzz_streams.py, test_user_code_faults.py, ...):

    mock = start_mock_llm(port, latency_ms=50)                              # OpenAI-compatible, token ids
    with mock_llm_stack(tmp, redis_url, database_url, services) as live:   # model + mock + services
    register_dataset(engine, "arith", 100)                                  # builtin arithmetic rows
    run_id = insert_run(engine, config)                                    # what POST /v1/runs does
    wait_run_ended(engine, run_id, 120); accounting(engine, run_id)        # judged by tests.support.audit

The servers: infra.local.servers; the services: infra.local.stack.LocalStack; the model: tests.support.tiny_model.
"""

from __future__ import annotations

import contextlib
import subprocess
import uuid
from pathlib import Path

from sqlalchemy import Engine, text

from infra.local.ports import wait_port
from tests.support.procs import start_service, wait_until

REPO = Path(__file__).resolve().parents[2]
TERMINAL = ("completed", "failed", "stopped")


def start_mock_llm(port: int, latency_ms: float, answer: str = "The answer is \\boxed{1}.",
                   tokenizer: str | None = None) -> subprocess.Popen:
    """tests.support.mock_llm as a process on 127.0.0.1:port; its base URL is http://127.0.0.1:port/v1. `tokenizer`
    (a model folder): token-id prompts are decoded, so `answer="correct"` can answer them."""
    proc = start_service("tests.support.mock_llm", log=subprocess.DEVNULL,
                         args=["--port", str(port), "--latency-ms", str(latency_ms), "--answer", answer,
                               *(["--tokenizer", tokenizer] if tokenizer else [])])
    wait_port(port, proc)
    return proc


@contextlib.contextmanager
def mock_llm_stack(tmp: Path, redis_url: str, database_url: str, services: list[str], *, latency_ms: float = 5,
                   answer: str | None = None, env: dict | None = None, healthy_s: float = 90):
    """A tiny model, the mock LLM and `services` of the local stack on these Redis/Postgres URLs (text logs, 0.2 s
    polls, `env` on top); yields {stack, engine, model, llm (the mock's base URL)}; everything stopped after."""
    from infra.local.ports import free_port
    from infra.local.stack import LocalStack
    from shared.platform.db.session import make_engine
    from tests.support.tiny_model import build_tiny_model

    model = str(build_tiny_model(tmp / "model"))
    port = free_port()
    mock = start_mock_llm(port, latency_ms, **({"answer": answer} if answer is not None else {}))
    stack = LocalStack(tmp / "stack", env={"REDIS_URL": redis_url, "DATABASE_URL": database_url, "LOG_FORMAT": "text",
                                           "RUNS_POLL_S": "0.2", "POLL_INTERVAL_S": "0.2", **(env or {})})
    engine = make_engine(database_url)
    try:
        stack.start(services=services)
        stack.wait_healthy(healthy_s)
        yield {"stack": stack, "engine": engine, "model": model, "llm": f"http://127.0.0.1:{port}/v1"}
    finally:
        stack.stop()
        mock.terminate()
        mock.wait(10)
        engine.dispose()


def register_dataset(engine: Engine, name: str, n: int, split: str = "test", seed: int = 0) -> None:
    """n builtin arithmetic rows; task ids are `arith-<seed>-<i>`."""
    from services.jobs.builtin_datasets import generate
    from shared.stores.datasets import DatasetRegistry

    DatasetRegistry(engine).register(name, generate("arithmetic", n, seed=seed), split)


def insert_run(engine: Engine, config: dict) -> str:
    """A pending run as the controller creates it for a `create` command (the config validated the same way),
    written directly: the test support's shortcut for stacks without an API. A controller then drives it."""
    from sqlalchemy.orm import Session

    from shared.contracts.db.models import Run
    from shared.contracts.run_config import RunConfig

    cfg = RunConfig.model_validate(config)
    run_id = uuid.uuid4()
    with Session(engine) as s:
        s.add(Run(id=run_id, name=cfg.name, kind=cfg.kind, status="pending", config=cfg.model_dump(mode="json")))
        s.commit()
    return str(run_id)


# -- observation ---------------------------------------------------------------------------------------------------
def stored_count(engine: Engine, run_id: str) -> int:
    """Completed episodes stored so far; -1 while Postgres is unreachable."""
    try:
        with engine.connect() as c:
            return c.execute(text("SELECT count(*) FROM episodes WHERE run_id = :r AND status = 'completed'"),
                             {"r": run_id}).scalar_one()
    except Exception:
        return -1


def run_status(engine: Engine, run_id: str) -> str:
    try:
        with engine.connect() as c:
            return c.execute(text("SELECT status FROM runs WHERE id = :r"), {"r": run_id}).scalar_one()
    except Exception:
        return "unknown"


def wait_run_ended(engine: Engine, run_id: str, timeout_s: float, *, procs=()) -> str:
    """The run's status once it ended (completed, failed, stopped), or its status when the time ran out; raises
    as soon as one of `procs` (the services serving it) exits."""
    with contextlib.suppress(TimeoutError):
        return wait_until(lambda: (status := run_status(engine, run_id)) in TERMINAL and status, timeout_s,
                          f"run {run_id} to end", procs=procs, interval_s=0.3)
    return run_status(engine, run_id)


def accounting(engine: Engine, run_id: str) -> dict[str, int]:
    from tests.support.audit import run_accounting

    with engine.connect() as c:
        return run_accounting(c, run_id)
