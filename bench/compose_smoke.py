"""`make compose-smoke` (python -m bench.compose_smoke): the project's own docker-compose.yml, really up.

1. infra/compose/podman-host.sh all: rootful podman + Docker Compose v2, a local base and stand-in redis/postgres
   images when no registry is reachable, then the flywheel-cpu and flywheel-trainer images (build_s).
2. `docker compose up -d` with no profile (a private project name, fresh volumes) while a healthcheck loop runs
   (podman 4.3 without systemd never runs them itself); waits until every long-lived service is healthy and
   the one-shot services exited 0 (up_s).
3. Through the REST API (run_s): a dataset upload, an evaluation run on the tiny model `model-init` wrote,
   completed; a training run until it has trained `--train-steps` versions. Postgres (through
   `docker compose exec postgres psql`) must hold every run's trajectories, and the training run's rollouts
   must have been served by at least 2 hot-reloaded policy versions (versions >= 1). A code-env evaluation
   runs the model's code in the env worker's sandbox (every step's info says `sandbox: namespaces`), and the
   escape suite runs inside the env-worker container (`python -m tests.support.sandbox_escapes`): all contained.
4. `docker compose down -v`, and bench/results/compose.json: services, healthy, eval_completed,
   code_env_completed, escapes, train_versions_served, build_s, up_s, run_s, podman and compose versions.
Exit status 0 only when every check passed.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import signal
import subprocess
import sys
import time
from pathlib import Path

from infra.local.ports import free_port

REPO = Path(__file__).resolve().parents[1]
SETUP = REPO / "infra" / "compose" / "podman-host.sh"
ONE_SHOT = {"migrate", "model-init"}
MODEL = "/weights/models/tiny"


def log(msg: str) -> None:
    print(f"[compose-smoke] {msg}", flush=True)


def load_env(path: Path) -> dict[str, str]:
    """The `export K=V` lines podman-host.sh writes."""
    out = {}
    for line in path.read_text().splitlines():
        if line.startswith("export ") and "=" in line:
            key, _, value = line[len("export "):].partition("=")
            out[key] = value
    return out


class Stack:
    """`docker compose` on the project's file under a private project name, with the host's env file."""

    def __init__(self, env: dict[str, str], project: str):
        self.env, self.project = env, project
        self.base = [env["COMPOSE"], "-f", str(REPO / "docker-compose.yml"), "-p", project]

    def compose(self, *args: str, check: bool = True, capture: bool = False, timeout: float = 900):
        return subprocess.run([*self.base, *args], env=self.env, cwd=REPO, check=check, text=True,
                              capture_output=capture, timeout=timeout)

    def services(self) -> list[dict]:
        out = self.compose("ps", "-a", "--format", "json", capture=True).stdout
        return [json.loads(line) for line in out.splitlines() if line.strip()]

    def declared(self) -> list[str]:
        return self.compose("config", "--services", capture=True).stdout.split()

    def psql(self, sql: str) -> str:
        return self.compose("exec", "-T", "postgres", "psql", "-U", "flywheel", "-d", "flywheel", "-tA", "-c", sql,
                            capture=True).stdout.strip()


def wait_healthy(stack: Stack, timeout_s: float) -> tuple[bool, dict[str, str]]:
    """Every declared service: long-lived ones `healthy`, one-shots exited 0. Returns (ok, state by service)."""
    declared = set(stack.declared())
    deadline = time.monotonic() + timeout_s
    state: dict[str, str] = {}
    while time.monotonic() < deadline:
        state = {}
        for c in stack.services():
            if c["Service"] in ONE_SHOT:
                state[c["Service"]] = "exited 0" if c["State"] == "exited" and c["ExitCode"] == 0 else c["State"]
            else:
                state[c["Service"]] = c.get("Health") or c["State"]
        failed = [s for s in ONE_SHOT if state.get(s, "").startswith("exited") and state[s] != "exited 0"]
        if failed:
            return False, state
        if set(state) >= declared and all(v in ("healthy", "exited 0") for v in state.values()):
            return True, state
        time.sleep(3)
    return False, state


def wait_run(api, run_id: str, done, timeout_s: float) -> dict:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        run = api.get(f"/v1/runs/{run_id}").json()
        if done(run) or run["status"] in ("completed", "failed", "stopped"):
            return run
        time.sleep(2)
    return api.get(f"/v1/runs/{run_id}").json()


def run_config(kind: str, dataset: str, **extra) -> dict:
    return {"name": f"compose-smoke-{kind}", "kind": kind, "model": MODEL, "dataset": dataset,
            "agent": {"name": "math"}, "env": {"name": "math"}, "engine": {"type": "hf"},
            "max_prompt_tokens": 256, "max_response_tokens": 8, "trajectory_timeout_s": 120.0, **extra}


# Code tasks as input/output cases: whatever the tiny model writes runs in the env worker's sandbox.
CODE_ROWS = [{"question": "Read two integers from stdin and print their sum.",
              "tests": [{"input": f"{a} {b}\n", "output": str(a + b)}]} for a, b in ((1, 2), (3, 4))]


def upload(api, name: str, rows: list[dict]) -> None:
    body = "\n".join(json.dumps(r) for r in rows).encode()
    stored = api.post("/v1/datasets", data={"name": name, "split": "train"}, files={"file": (f"{name}.jsonl", body)})
    if stored.status_code != 201:  # 202: the jobs worker, which stores uploads, did not import it in time
        raise RuntimeError(f"uploading {name}: {stored.status_code} {stored.text[:500]}")


def exercise(stack: Stack, api_url: str, token: str, train_steps: int, timeout_s: float) -> dict:
    """The evaluation, code-env and training runs through REST, then the checks against Postgres."""
    import httpx

    from services.jobs.builtin_datasets import generate

    api = httpx.Client(base_url=api_url, headers={"Authorization": f"Bearer {token}"}, timeout=30)
    upload(api, "smoke-arith", generate("arithmetic", 16, seed=1))
    upload(api, "smoke-code", CODE_ROWS)

    ev = api.post("/v1/runs", json=run_config("eval", "smoke-arith", max_tasks=4, samples_per_task=2))
    ev.raise_for_status()
    eval_run = wait_run(api, ev.json()["id"], lambda r: False, timeout_s)
    log(f"eval run {eval_run['id']}: {eval_run['status']} {eval_run.get('error') or ''}")

    code = api.post("/v1/runs", json={**run_config("eval", "smoke-code", max_tasks=2, samples_per_task=1),
                                       "name": "compose-smoke-code", "agent": {"name": "code"},
                                       "env": {"name": "code"}, "max_response_tokens": 16})
    code.raise_for_status()
    code_run = wait_run(api, code.json()["id"], lambda r: False, timeout_s)
    # Every env step of the run: what the sandbox reported (mode, the program's own error, e.g. a SyntaxError).
    sandboxed = stack.psql(
        "SELECT s.info->>'sandbox', coalesce(s.info->>'error', 'passed') FROM steps s JOIN trajectories t "
        f"ON t.id = s.trajectory_id WHERE t.run_id = '{code_run['id']}' AND s.info ? 'duration_s'").splitlines()
    log(f"code-env run {code_run['id']}: {code_run['status']} {code_run.get('error') or ''}; steps {sandboxed}")

    tr = api.post("/v1/runs", json=run_config(
        "train", "smoke-arith", samples_per_task=2, tasks_per_batch=2, total_steps=train_steps,
        max_in_flight=8, algorithm={"adv_estimator": "grpo", "lr": 1e-3}))
    tr.raise_for_status()
    train_run = wait_run(api, tr.json()["id"], lambda r: r["policy_version"] >= train_steps, timeout_s)
    log(f"train run {train_run['id']}: {train_run['status']} at version {train_run['policy_version']} "
        f"{train_run.get('error') or ''}")
    if train_run["status"] not in ("completed", "failed", "stopped"):
        api.post(f"/v1/runs/{train_run['id']}/stop")

    def trajectories(run_id: str) -> int:
        return int(stack.psql(f"SELECT count(*) FROM trajectories WHERE run_id = '{run_id}'") or 0)

    served = stack.psql(f"SELECT DISTINCT policy_version_max FROM trajectories WHERE run_id = '{train_run['id']}' "
                        "AND policy_version_max >= 1 ORDER BY 1")
    return {
        "eval_run": eval_run["id"], "eval_status": eval_run["status"],
        "eval_completed": eval_run["status"] == "completed",
        "eval_trajectories": trajectories(eval_run["id"]),
        "code_env_run": code_run["id"], "code_env_status": code_run["status"],
        "code_env_trajectories": trajectories(code_run["id"]), "code_env_steps": sandboxed[:4],
        # every trajectory's program ran in the sandbox (an env that failed to run it leaves no such step)
        "code_env_completed": (code_run["status"] == "completed" and len(sandboxed) >= trajectories(code_run["id"]) > 0
                               and all(line.startswith("namespaces|") for line in sandboxed)),
        "train_run": train_run["id"], "train_status": train_run["status"],
        "train_policy_version": train_run["policy_version"],
        "train_trajectories": trajectories(train_run["id"]),
        "train_versions_served": len(served.split()),
    }


def escapes_in_env_worker(stack: Stack) -> dict:
    """The escape suite inside the env-worker container, as its user, under the sandbox the worker runs."""
    out = stack.compose("exec", "-T", "env-worker", "python", "-m", "tests.support.sandbox_escapes", check=False,
                        capture=True, timeout=600)
    try:
        return json.loads(out.stdout.strip().splitlines()[-1])
    except (IndexError, json.JSONDecodeError):
        return {"error": (out.stdout + out.stderr)[-2000:]}


def versions(env: dict[str, str]) -> dict:
    def first_line(*cmd: str) -> str:
        out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
        return (out.stdout or out.stderr).strip().splitlines()[0] if (out.stdout or out.stderr).strip() else ""

    return {"podman": first_line("podman", "--version"), "compose": first_line(env["COMPOSE"], "version")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "compose.json")
    parser.add_argument("--project", default="flywheel-smoke", help="compose project name (its own volumes)")
    parser.add_argument("--skip-setup", action="store_true", help="images already built: no podman-host.sh all")
    parser.add_argument("--keep", action="store_true", help="leave the stack running (no `down -v`)")
    parser.add_argument("--train-steps", type=int, default=4)
    parser.add_argument("--timeout", type=float, default=600, help="seconds for health, and for each run")
    args = parser.parse_args()

    started = time.monotonic()
    state_dir = Path(os.environ.get("STATE", REPO / ".data" / "compose"))
    timings = state_dir / "timings.log"
    logged = len(timings.read_text().splitlines()) if timings.exists() else 0
    if not args.skip_setup:
        subprocess.run(["bash", str(SETUP), "all"], check=True, cwd=REPO)
    build_s = time.monotonic() - started
    token = secrets.token_hex(16)
    api_port = free_port()
    env = {**os.environ, **load_env(state_dir / "env"), "POSTGRES_PASSWORD": secrets.token_hex(12),
           "API_TOKEN": token, "API_PORT": str(api_port), "COMPOSE_PROJECT": args.project}
    stack = Stack(env, args.project)
    result: dict = {"services": [], "healthy": False, "eval_completed": False, "code_env_completed": False,
                    "train_versions_served": 0, "build_s": round(build_s, 1), "up_s": None, "run_s": None,
                    **versions(env)}
    if timings.exists():  # this run's steps: "<time> <step> <seconds>s" (cached steps take a few seconds)
        result["build_timings"] = timings.read_text().splitlines()[logged:]

    loop = subprocess.Popen(["bash", str(SETUP), "health-loop"], env=env, start_new_session=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    ok = False
    try:
        stack.compose("down", "-v", "--remove-orphans", check=False, capture=True)
        up_started = time.monotonic()
        stack.compose("up", "-d", "--no-build")
        healthy, state = wait_healthy(stack, args.timeout)
        result.update(services=sorted(state), healthy=healthy, service_state=state,
                      up_s=round(time.monotonic() - up_started, 1))
        log(f"services {'healthy' if healthy else 'NOT healthy'} in {result['up_s']} s: {state}")
        if healthy:
            run_started = time.monotonic()
            result.update(exercise(stack, f"http://127.0.0.1:{api_port}", token, args.train_steps, args.timeout))
            result["run_s"] = round(time.monotonic() - run_started, 1)
            escapes_started = time.monotonic()
            result["escapes"] = escapes_in_env_worker(stack)
            result["escapes_s"] = round(time.monotonic() - escapes_started, 1)
            log(f"escape suite in the env-worker container: {result['escapes']}")
            ok = (result["eval_completed"] and result["eval_trajectories"] > 0 and result["train_trajectories"] > 0
                  and result["train_versions_served"] >= 2 and result["code_env_completed"]
                  and result["escapes"].get("total", 0) > 0 and not result["escapes"].get("escaped", True))
        if not ok:
            logs = stack.compose("logs", "--no-color", "--tail", "40", check=False, capture=True)
            (state_dir / "smoke-failure.log").write_text(logs.stdout + logs.stderr)
            log(f"service logs: {state_dir / 'smoke-failure.log'}")
    finally:
        os.killpg(loop.pid, signal.SIGTERM)
        if not args.keep:
            stack.compose("down", "-v", "--remove-orphans", check=False, capture=True)
        result["ok"] = ok
        result["total_s"] = round(time.monotonic() - started, 1)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1) + "\n")
        print(json.dumps(result, indent=1))
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
