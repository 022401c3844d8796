"""Managed agent programs: a rollout task of a run with `agent_program` runs the user's function in its own
process, talking to the policy through a gateway session of this worker, and ends as an EpisodeResult on
`trajectories` like every other rollout.

The child process (agent_runner.py) has its own process group and temp dir, address-space, CPU and wall-clock
limits. A program that raises or exits non-zero ends with ERROR, one that overruns is killed and ends with
TIMEOUT; either way the calls it made are kept (masked from the loss) and the worker goes on.

More: docs/agents-and-envs.md#gateway-sessions-and-agent-processes
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from prometheus_client import Counter

from services.rollout_worker.episodes import completed, trajectory_budget
from services.rollout_worker.gateway import Gateway, GatewaySession
from shared.contracts.messages import EpisodeResult, RolloutTask
from shared.contracts.registry import EXTERNAL_AGENT_PROGRAM
from shared.platform.logs import get_logger
from shared.platform.service import wait_for
from shared.sdk.types import Episode
from shared.sdk.types import TerminationReason as TR

log = get_logger(__name__)
PROGRAMS = Counter("agent_program_runs_total", "Managed agent program runs", ["outcome"])
ERROR_TAIL = 8000


class AgentPrograms:
    def __init__(self, gateway: Gateway, memory_bytes: int, kill_grace_s: float = 5.0):
        self.gateway, self.memory_bytes, self.kill_grace_s = gateway, memory_bytes, kill_grace_s

    async def run(self, ctx: Any, task: RolloutTask) -> EpisodeResult:
        started = time.time()
        budget = trajectory_budget(ctx, task)
        session = self.gateway.open(ctx, task.greedy, time.monotonic() + budget)
        try:
            if ctx.config.agent_program.name == EXTERNAL_AGENT_PROGRAM:
                reason, outcome = await self.external(task, session, budget)
            else:
                reason, outcome = await self.spawn(ctx, task, session, budget)
        finally:
            self.gateway.close_session(session)
        PROGRAMS.labels(reason.value).inc()
        result = completed(ctx, task, build_episode(task, session, reason, outcome))
        result.started_at, result.finished_at = started, time.time()
        return result

    async def external(self, task: RolloutTask, session: GatewaySession, budget: float) -> tuple[TR, dict]:
        """Wait for a program elsewhere to claim the session and post its reward; silence is a TIMEOUT."""
        outcome = self.gateway.offer(session, task)
        try:
            return TR.ENV_DONE, await wait_for(outcome, budget)
        except TimeoutError:
            claimed = "claimed but" if session not in self.gateway.waiting.get(task.run_id, []) else "never claimed and"
            return TR.TIMEOUT, {"error": f"external agent session {claimed} no reward posted within {budget:.0f}s "
                                         "(trajectory_timeout_s)"}

    async def spawn(self, ctx: Any, task: RolloutTask, session: GatewaySession,
                    budget: float) -> tuple[TR, dict]:
        spec = ctx.config.agent_program
        base_url = self.gateway.base_url(session, host="127.0.0.1")
        workdir = Path(tempfile.mkdtemp(prefix="fw-agent-"))
        result_path = workdir / "result.json"
        stderr_path = workdir / "stderr.txt"
        env = {k: v for k, v in os.environ.items() if not k.endswith(("_URL", "PASSWORD", "TOKEN", "SECRET"))}
        env.update(OPENAI_BASE_URL=base_url, OPENAI_API_KEY="flywheel", FLYWHEEL_BASE_URL=base_url,
                   PYTHONPATH=os.pathsep.join(p for p in sys.path if p), PYTHONUNBUFFERED="1")
        payload = json.dumps({"program": spec.name, "args": spec.args, "task": task.task, "base_url": base_url,
                              "result_path": str(result_path),
                              "limits": {"memory_bytes": self.memory_bytes, "cpu_s": int(budget) + 10}}).encode()
        try:
            with open(stderr_path, "wb") as err:
                proc = await asyncio.create_subprocess_exec(
                    sys.executable, "-m", "services.rollout_worker.agent_runner", cwd=workdir, env=env,
                    stdin=asyncio.subprocess.PIPE, stdout=err, stderr=err, start_new_session=True)
            try:
                await wait_for(proc.communicate(payload), budget)
            except TimeoutError:
                _kill_group(proc)
                await proc.wait()
                return TR.TIMEOUT, {"error": f"agent program {spec.name} did not finish within {budget:.0f}s "
                                             "(trajectory_timeout_s); its process group was killed",
                                    "stderr": _tail(stderr_path)}
            except asyncio.CancelledError:
                _kill_group(proc)
                raise
            finally:
                _kill_group(proc)  # whatever the program left running in its group
            if proc.returncode != 0 or not result_path.exists():
                how = (f"killed by signal {signal.Signals(-proc.returncode).name}" if proc.returncode < 0
                       else f"exit code {proc.returncode}")
                return TR.ERROR, {"error": f"agent program {spec.name} failed ({how}):\n{_tail(stderr_path)}"}
            return TR.ENV_DONE, json.loads(result_path.read_text())
        finally:
            shutil.rmtree(workdir, ignore_errors=True)

def build_episode(task: RolloutTask, session: GatewaySession, reason: TR, outcome: dict) -> Episode:
    """Every agent's segments become trajectories; the program's reward goes on each one's last step."""
    reward = float(outcome.get("reward", 0.0))
    per_agent = outcome.get("rewards") or {}
    is_correct = bool(outcome.get("is_correct", reward > 0)) if reason == TR.ENV_DONE else False
    if reason == TR.ENV_DONE and session.context_exceeded:  # the gateway refused a call for the context window
        reason = TR.CONTEXT_EXCEEDED
    trajectories = session.trajectories()
    for traj in trajectories:
        r = float(per_agent.get(traj.name, reward))
        if traj.steps:
            traj.steps[-1].reward, traj.steps[-1].done = r, True
        traj.reward, traj.termination_reason, traj.task = r, reason, task.task
        traj.info["is_correct"] = is_correct
        if "error" in outcome:
            traj.info["error"] = outcome["error"]
    info = {**(outcome.get("info") or {}), "mismatches": session.mismatches, "gateway_calls": session.calls}
    if "error" in outcome:
        info["error"] = outcome["error"]
    if "stderr" in outcome and outcome["stderr"]:
        info["stderr"] = outcome["stderr"]
    uid = f"{task.task_id}:{task.sample_idx}:{task.attempt}"
    return Episode(id=uid, task=task.task, termination_reason=reason, is_correct=is_correct,
                   trajectories=trajectories, info=info,
                   metrics={"num_trajectories": len(trajectories), "mismatches": session.mismatches,
                            "gateway_calls": session.calls})


def _kill_group(proc: asyncio.subprocess.Process) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)


def _tail(path: Path) -> str:
    try:
        return path.read_bytes()[-ERROR_TAIL:].decode(errors="replace")
    except OSError:
        return ""
