"""Background job kinds and their Celery task names: the contract between the API (which inserts a `jobs`
row and sends the task by name) and services/jobs (which runs it and records the outcome in that row).

Every task takes one argument, the job id; its parameters are in `jobs.params`."""

JOB_TASKS: dict[str, str] = {
    "import_dataset": "flywheel.import_dataset",  # params: name, split, path | generator (+ n, seed), format
    "evaluate": "flywheel.evaluate",  # params: config (RunConfig JSON), checkpoint_run_id?, checkpoint_version?
    "export": "flywheel.export_trajectories",  # params: run_id; result: path of a parquet file
    "gc": "flywheel.gc",  # params: keep_checkpoints, trim_streams
    "sync_tracking": "flywheel.sync_tracking",  # params: run_id; pushes metrics to W&B / MLflow when enabled
}
JOB_STATUSES = ("queued", "running", "succeeded", "failed")
