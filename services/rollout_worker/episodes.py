"""One RolloutTask -> one EpisodeResult: run the workflow (or the single-agent loop), retry episodes that
ended in ERROR, assemble each trajectory's tokens, classify the outcome:

- completed: a scored result (whatever the reward, TIMEOUT and truncations included: the policy's doing);
- error: the user's code failed: an env, reward function, agent, workflow or agent program raised, returned
  the wrong type (ERROR) or the env hung past env_step_timeout_s (ENV_TIMEOUT). `error` starts with one line,
  "<where>: <exception line>", then the traceback; never trained on, never scored;
- failed: infrastructure failed (InfraFailure, WorkflowTerminated(INFRA_ERROR)): re-dispatched by the controller.
"""

from __future__ import annotations

import dataclasses
import time
import traceback

from prometheus_client import Counter, Histogram

from services.rollout_worker.assembly import assemble, context_runs
from services.rollout_worker.builtin.workflows import SingleAgentWorkflow
from services.rollout_worker.env_client import EnvClient
from services.rollout_worker.rollout import Rollout
from services.rollout_worker.run_engines import RunContext
from shared.contracts.messages import EpisodeResult, RolloutTask, TrajectoryRecord
from shared.platform.logs import get_logger
from shared.platform.service import wait_for
from shared.sdk.agent import Episode, WorkflowTerminated
from shared.sdk.types import TerminationReason as TR
from shared.sdk.types import Trajectory, compute_mc_returns

log = get_logger(__name__)
EPISODES = Counter("rollout_episodes_total", "Episodes finished", ["status", "termination"])
EPISODE_SECONDS = Histogram("rollout_episode_seconds", "Episode wall time",
                            buckets=(0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60, 300, 1800))
REWRITES = Counter("rollout_context_rewrites_total", "Turns whose prompt did not extend the accumulated context "
                   "(the agent rewrote its history): each starts a new training sequence")
GRACE_S = 5.0  # after the deadline, the loop's own TIMEOUT handling gets this long before we cancel


async def run_episode(ctx: RunContext, envs: EnvClient, task: RolloutTask, worker_id: str,
                      error_retries: int) -> EpisodeResult:
    started = time.time()
    budget = trajectory_budget(ctx, task)
    for attempt in range(error_retries + 1):
        rollout = Rollout(ctx, envs, task, time.monotonic() + budget)
        result = await _run_once(ctx, rollout, task, budget)
        if result.status != "error" or result.termination_reason != TR.ERROR or attempt == error_retries:
            break
        log.info("episode %s ended in ERROR; retrying", rollout.uid, extra={"run_id": task.run_id})
    result.worker_id, result.started_at, result.finished_at = worker_id, started, time.time()
    EPISODES.labels(result.status, result.termination_reason.value).inc()
    EPISODE_SECONDS.observe(result.finished_at - started)
    return result


def trajectory_budget(ctx: RunContext, task: RolloutTask) -> float:
    """Wall seconds a trajectory may run: the task's budget, within the run's. Not cut to the attempt's lease:
    a trajectory ended early by a queue wait would be stored as a TIMEOUT its env never caused; the worker
    abandons an attempt whose lease runs out instead (RolloutWorker.run_task)."""
    return min(task.deadline_s, ctx.config.trajectory_timeout_s)


async def _run_once(ctx: RunContext, rollout: Rollout, task: RolloutTask, budget: float) -> EpisodeResult:
    workflow_cls = ctx.workflow_cls or SingleAgentWorkflow
    args = ctx.config.workflow.args if ctx.config.workflow else {}
    try:
        workflow = workflow_cls(rollout=rollout, **args)
        episode = await wait_for(workflow.run(dict(task.task), rollout.uid), budget + GRACE_S)
    except WorkflowTerminated as e:
        if e.reason == TR.INFRA_ERROR:
            return failed(task, str(e))
        episode = Episode(id=rollout.uid, task=task.task, termination_reason=e.reason, info={"error": str(e)})
    except TimeoutError:
        episode = Episode(id=rollout.uid, task=task.task, termination_reason=TR.TIMEOUT)
    except Exception:  # the user's workflow raised
        episode = Episode(id=rollout.uid, task=task.task, termination_reason=TR.ERROR,
                          info={"error": traceback.format_exc(limit=20)[-8000:],
                                "error_source": f"workflow {workflow_cls.__name__}"})
    return completed(ctx, task, episode)


def completed(ctx: RunContext, task: RolloutTask, episode: Episode) -> EpisodeResult:
    records = []
    for traj in episode.trajectories:
        compute_mc_returns(traj, ctx.config.algorithm.gamma)  # over the whole trajectory, before any cut
        for part in sequences(traj):
            part.tokens = assemble(part.steps)
            records.append(TrajectoryRecord.from_trajectory(part).compact())  # linear in turns on the wire
    reason = episode.termination_reason or TR.UNKNOWN
    # One trajectory: its reward. Several (solver/judge): whether the episode was right.
    reward = records[0].reward if len(records) == 1 else float(episode.is_correct)
    info = dict(episode.info)
    if reason in (TR.ERROR, TR.ENV_TIMEOUT, TR.TIMEOUT) and "error" not in info:
        info["error"] = next((t.info["error"] for t in records if t.info.get("error")), None)
    status, error = "completed", info.get("error")
    if reason in USER_FAULTS:
        source = info.get("error_source") or next(
            (t.info["error_source"] for t in records if t.info.get("error_source")), None) or _default_source(ctx)
        info["error_source"] = source
        status, error = "error", user_error(source, error)
    return EpisodeResult(
        run_id=task.run_id, task_id=task.task_id, sample_idx=task.sample_idx, attempt=task.attempt,
        status=status, termination_reason=reason, is_correct=episode.is_correct, reward=reward,
        task=task.task, trajectories=records, metrics=episode.metrics, info=info, batch_idx=task.batch_idx,
        greedy=task.greedy, error=error,
    )


def sequences(traj: Trajectory) -> list[Trajectory]:
    """The trajectory, or, when the agent rewrote its history, one trajectory per run of turns that extends one
    context (`context_runs`): each carries the whole trajectory's reward and `info` `sequence` k of `sequences`
    n, `first_turn` (the store numbers its steps from there), the last also `context_rewrites` n-1 (one count per trajectory: SQL sums it); the trainer gives every one
    the advantage of the last (`advantage_from`)."""
    runs = context_runs(traj.steps)
    if len(runs) == 1:
        return [traj]
    REWRITES.inc(len(runs) - 1)
    reward = traj.reward if traj.reward is not None else sum(s.reward for s in traj.steps)
    firsts = [sum(len(r) for r in runs[:k]) for k in range(len(runs))]  # each run's first turn in the whole
    return [dataclasses.replace(traj, uid=f"{traj.uid}/{k}", steps=steps, reward=reward, tokens=None,
                                info={**traj.info, "sequence": k, "sequences": len(runs), "first_turn": firsts[k]}
                                | ({"context_rewrites": len(runs) - 1} if k == len(runs) - 1 else {}))
            for k, steps in enumerate(runs)]


USER_FAULTS = (TR.ERROR, TR.ENV_TIMEOUT)  # endings caused by the user's code, not the policy


def _default_source(ctx: RunContext) -> str:
    if ctx.config.agent_program:
        return f"agent program {ctx.config.agent_program.name}"
    return f"workflow {(ctx.workflow_cls or SingleAgentWorkflow).__name__}"


def user_error(source: str, error: str | None) -> str:
    """"<where>: <what>" on the first line (the reason runs are summarized by), then the full error."""
    lines = [line.strip() for line in (error or "").strip().splitlines() if line.strip()]
    what = lines[-1][:300] if lines else "no error message"
    return f"{source}: {what}" + (f"\n{error}" if error and error.strip() != what else "")


def failed(task: RolloutTask, error: str) -> EpisodeResult:
    return EpisodeResult(
        run_id=task.run_id, task_id=task.task_id, sample_idx=task.sample_idx, attempt=task.attempt,
        status="failed", termination_reason=TR.INFRA_ERROR, task=task.task, error=error, batch_idx=task.batch_idx,
        greedy=task.greedy,
    )
