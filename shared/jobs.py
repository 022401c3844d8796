"""Background job kinds and their Celery task names: the contract between the API (which inserts a `jobs`
row and sends the task by name) and services/jobs (which runs it and records the outcome in that row). A job
refused for its input records why in `result.refused` (JOB_REFUSALS) beside its error message.

Every task takes one argument, the job id; its parameters are in `jobs.params`."""

JOB_TASKS: dict[str, str] = {
    # params: name, split, path | generator (+ n, seed), format; `upload` (the file's name): the API's upload,
    # a file it wrote under DATA_DIR/uploads, removed once imported or refused
    "import_dataset": "flywheel.import_dataset",
    "delete_dataset": "flywheel.delete_dataset",  # params: name, split?, version?; result: deleted (versions)
    "evaluate": "flywheel.evaluate",  # params: config (RunConfig JSON), checkpoint_run_id?, checkpoint_version?
    "export": "flywheel.export_trajectories",  # params: run_id; result: path of a parquet file
    "gc": "flywheel.gc",  # params: keep_checkpoints, trim_streams
    "sync_tracking": "flywheel.sync_tracking",  # params: run_id; pushes metrics to W&B / MLflow when enabled
}
JOB_STATUSES = ("queued", "running", "succeeded", "failed")
JOB_REFUSALS = ("invalid", "not_found", "in_use")


def celery_broker_url(redis_url: str) -> str:
    """The Celery broker URL of REDIS_URL, so one REDIS_URL serves every component however it is started.
    kombu spells a unix-socket Redis `redis+socket:///path?virtual_host=N` and rejects redis-py's
    `unix:///path?db=N` ("No such transport: unix"), which is what the embedded Redis of the local stack gives;
    every other URL is the same for both."""
    if not redis_url.startswith("unix://"):
        return redis_url
    path, _, query = redis_url[len("unix://"):].partition("?")
    db = dict(p.split("=", 1) for p in query.split("&") if "=" in p).get("db", "0")
    return f"redis+socket://{path}?virtual_host={db}"
