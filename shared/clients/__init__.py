"""What one service uses to ask another: run commands to the controller (run_commands.py), jobs to the jobs
service (jobs.py)."""
