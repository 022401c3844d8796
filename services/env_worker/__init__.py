"""env-worker: hosts environment instances as sticky sessions (see worker.py)."""
