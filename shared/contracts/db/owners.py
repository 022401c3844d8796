"""Who writes each table, who reads it, and what changes it: one owner per table. A service learns what another
did from a message (shared/contracts/streams.py), never by reading that service's table; a reader here reads rows for
what they hold for users or for the reader's own work (a run's config, a checkpoint's path).

tests/contract/test_table_owners.py reads the code and fails when a service writes a table it does not own or reads
a table it is not listed for. The "Who owns what" table of docs/architecture.md shows this map.
"""

from __future__ import annotations

from dataclasses import dataclass

SERVICES = frozenset({"api", "controller", "env_worker", "jobs", "rollout_worker", "trainer", "weight_server"})


@dataclass(frozen=True)
class TableOwner:
    owner: str
    readers: tuple[str, ...]
    changed_by: str  # the messages or requests that change the table, as the README lists them


OWNERS: dict[str, TableOwner] = {
    "runs": TableOwner(
        "controller", ("api", "jobs", "rollout_worker", "trainer"),
        "`run.commands` (create, pause, resume, stop; complete and fail for tinker runs: from POST /v1/runs and its control routes, eval jobs, and the "
        "Tinker API's create_model and session finish); "
        "`trajectories` and `trainer.progress` (status, progress, summary, stall reason)"),
    "controller_leases": TableOwner(
        "controller", (), "taken and renewed by the controller driving each run (shared/platform/leases.py)"),
    "trainer_leases": TableOwner(
        "trainer", (), "taken and renewed by the trainer training each run (shared/platform/leases.py); the controller "
        "learns which trainer trains a run from the trainers' heartbeats"),
    "consumed_groups": TableOwner(
        "controller", (), "`trainer.progress` (the groups a policy version consumed or dropped)"),
    "run_events": TableOwner(
        "controller", ("api",), "every message that changes a run (the run's history): `run.commands` "
        "(`created`, `status_changed` with the command's id); `trainer.progress` errors as `trainer_error`"),
    "rollout_tasks": TableOwner("controller", ("api",), "the controller's dispatch; `trajectories` (each attempt's end)"),
    "episodes": TableOwner("controller", ("api", "jobs"), "`trajectories` (the store, exactly once)"),
    "trajectories": TableOwner("controller", ("api", "jobs"), "`trajectories` (the store, exactly once)"),
    "step_records": TableOwner("controller", (), "`trajectories` (the store, exactly once)"),
    "token_streams": TableOwner("controller", (), "`trajectories` (the store, exactly once)"),
    "steps": TableOwner("controller", ("api", "jobs"), "a view of `step_records` (each step with its whole chat)"),
    "token_arrays": TableOwner(
        "controller", ("api", "jobs"), "a view of `token_streams` (each step's arrays, sliced from the stream)"),
    "metrics": TableOwner(
        "trainer", ("api", "controller", "jobs"), "each policy version's step (loss, grad norm, rewards)"),
    "tracker_progress": TableOwner(
        "trainer", (), "each tracker call that logged a policy version (the trainer's tracking threads)"),
    "train_samples": TableOwner("trainer", (), "each policy version's step (which samples it trained on)"),
    "checkpoints": TableOwner(
        "weight_server", ("api", "jobs", "rollout_worker", "trainer"),
        "the trainer's uploads (PUT, then commit); retention after each publish, after an unpin (DELETE .../pin) "
        "and the jobs worker's GC (POST .../versions/retain), which keep pinned versions and what kept versions "
        "are built on"),
    "datasets": TableOwner(
        "jobs", ("api", "controller"), "jobs: an import (`POST /v1/datasets/import`, `flywheel datasets import`), "
        "an upload (`POST /v1/datasets`, imported from the file the API wrote), a delete (`DELETE /v1/datasets/...`)"),
    "dataset_rows": TableOwner("jobs", ("api", "controller"), "the same jobs, with the `datasets` row"),
    "jobs": TableOwner(
        "jobs", ("api",), "`jobs.requests` (queued: the routes that start a job); the scheduled GC; the jobs "
        "worker (running, succeeded, failed)"),
    "api_tokens": TableOwner("api", (), "`flywheel tokens` / `POST /v1/tokens`"),
}
