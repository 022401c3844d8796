"""The agent loop and episodes: one `Rollout` handle per task attempt, given to the workflow.

    env.reset (env worker) -> agent.update_from_env -> engine.generate -> agent.update_from_model
    -> env.step -> ... until done, max_steps, the token budgets, the context window or the deadline.

Failures are classified once, here: an env worker that does not answer or an engine that fails after its
retries raise `InfraFailure` (the episode is `failed`, re-dispatched, never trained on); user env errors and
user agent exceptions end the trajectory with ERROR and the traceback in `info["error"]`, and where it came from
(`env <name>.reset`, `agent <Class>.update_from_model`, ...) in `info["error_source"]`.
"""

from __future__ import annotations

import asyncio
import copy
import time
import traceback
from typing import Any

from prometheus_client import Counter, Histogram

from services.rollout_worker.assembly import PromptBuilder
from services.rollout_worker.engines import InferenceError, traced_generate
from services.rollout_worker.env_client import EnvClient, EnvSessionLost
from services.rollout_worker.run_engines import RunContext
from shared.contracts.messages import EnvReply, RolloutTask
from shared.platform.logs import get_logger
from shared.platform.service import wait_for
from shared.sdk.agent import BaseAgent, WorkflowTerminated
from shared.sdk.types import Action, Step, Trajectory
from shared.sdk.types import TerminationReason as TR

log = get_logger(__name__)
GEN_SECONDS = Histogram("rollout_generation_seconds", "One model call, queueing included")
TOKENS = Counter("rollout_tokens_total", "Tokens", ["kind"])


class InfraFailure(Exception):
    """Not the policy's fault: lost env session, dead inference. Retried as a new attempt by the controller."""


class Rollout:
    """The handle a workflow drives agents through (see services/rollout_worker/builtin/workflows.py)."""

    def __init__(self, ctx: RunContext, envs: EnvClient, task: RolloutTask, deadline: float):
        self.ctx, self.envs, self.task, self.deadline = ctx, envs, task, deadline
        self.cfg = ctx.config
        self.uid = f"{task.task_id}:{task.sample_idx}:{task.attempt}"
        self._sessions = 0

    def make_agent(self) -> BaseAgent:
        return self.ctx.agent_cls(**self.cfg.agent.args)

    def time_left(self) -> float:
        return self.deadline - time.monotonic()

    async def run_agent(self, agent: BaseAgent, task: dict, name: str = "agent",
                        env: tuple[str, dict] | None = None) -> Trajectory:
        env_name, env_args = env or (self.cfg.env.name, self.cfg.env.args)
        self._sessions += 1
        # The run id keeps sessions of two runs over the same dataset apart on the env workers.
        session_id = f"{self.task.run_id}:{self.uid}:{self._sessions}"
        session = AgentSession(self, agent, task, name, env_name, env_args, session_id)
        return await session.run()


class AgentSession:
    """One trajectory: an agent, an env session and the token bookkeeping."""

    def __init__(self, rollout: Rollout, agent: BaseAgent, task: dict, name: str, env_name: str,
                 env_args: dict, session_id: str):
        self.r, self.agent, self.task, self.name = rollout, agent, task, name
        self.env_name, self.env_args, self.session_id = env_name, env_args, session_id
        self.cfg = rollout.cfg
        self.owner: str | None = None
        self.builder = PromptBuilder(rollout.ctx.chat)
        self.info: dict[str, Any] = {}
        self.timings = {"gen_s": 0.0, "env_s": 0.0}
        self.trusted = type(agent).__module__.startswith("services.rollout_worker.builtin.")
        self.stage = f"agent {type(agent).__name__}"  # the user code running now: where an exception came from

    async def run(self) -> Trajectory:
        try:
            reason = await self.loop()
        except (EnvSessionLost, InferenceError) as e:
            raise WorkflowTerminated(TR.INFRA_ERROR, str(e)) from e
        except WorkflowTerminated:
            raise
        except TimeoutError:  # the user's agent blocked past the trajectory's deadline
            reason = TR.TIMEOUT
            self.info["error"] = "agent code did not return before the trajectory deadline (trajectory_timeout_s)"
        except Exception:  # the user's agent raised
            reason = TR.ERROR
            self.info["error"] = traceback.format_exc(limit=20)[-8000:]
            self.info["error_source"] = self.stage
        finally:
            if self.owner is not None:
                self.r.envs.close_quietly(self.session_id, run_id=self.r.task.run_id, env=self.env_name,
                                          owner=self.owner)
        return self.finish(reason)

    async def agent_call(self, fn, *args, where: str | None = None):
        """User agent code runs in a thread under the trajectory's deadline, so a blocking agent ends its own
        trajectory (TimeoutError -> TIMEOUT) instead of freezing every trajectory on this event loop. A thread
        that never returns cannot be killed: it is abandoned, like a hung env call. The built-in agents are
        ours and never block: they run inline (thread hops were ~15% of the loop in bench-rollout)."""
        self.stage = f"agent {type(self.agent).__name__}.{where or getattr(fn, '__name__', 'call')}"
        if self.trusted:
            return fn(*args)
        return await wait_for(asyncio.to_thread(fn, *args), max(self.r.time_left(), 0.001))

    async def loop(self) -> TR:
        await self.agent_call(self.agent.reset)
        reply = await self.env_call("reset", task=self.task)
        if not reply.ok:
            return self.env_failure(reply, "reset")
        self.owner = reply.env_worker_id
        await self.agent_call(self.agent.update_from_env, reply.observation, 0.0, False, reply.info)
        for _ in range(self.cfg.max_steps):
            if self.r.time_left() <= 0:
                return TR.TIMEOUT
            reason = await self.turn()
            if reason is not None:
                return reason
        return TR.MAX_STEPS

    async def turn(self) -> TR | None:
        """One model call and env step; a termination reason, or None to go on."""
        messages = await self.agent_call(lambda: self.agent.chat_completions, where="chat_completions")
        messages = copy.deepcopy(messages)  # appended in place
        prompt_ids = self.builder.prompt_ids(messages)
        max_tokens, spent = self.response_budget(prompt_ids)
        if max_tokens <= 0:
            return spent
        started = time.perf_counter()
        try:
            gen = await self.generate(prompt_ids, max_tokens)
        except TimeoutError:
            return TR.TIMEOUT
        gen_ms = (time.perf_counter() - started) * 1000
        action = await self.agent_call(self.agent.update_from_model, gen.text)
        step = await self.agent_call(self.agent.get_current_state)
        self.stage = f"agent {type(self.agent).__name__}.update_from_model"  # the wrong types came from there
        self.check_agent_output(action, step)
        if step.action is None:
            step.action = action.action
        step.prompt_ids, step.response_ids, step.logprobs = list(prompt_ids), gen.ids, gen.logprobs
        step.weight_version, step.response_versions, step.gen_ms = gen.weight_version, gen.versions or [], gen_ms
        step.info["finish_reason"] = gen.finish_reason
        self.builder.record(messages, prompt_ids, gen.ids, gen.text)
        action = step.action.action if hasattr(step.action, "action") else step.action
        started = time.perf_counter()
        reply = await self.env_call("step", action=action)
        step.env_ms = (time.perf_counter() - started) * 1000
        if not reply.ok:
            return self.env_failure(reply, "step")
        step.observation, step.reward, step.done = reply.observation, reply.reward, reply.done
        step.info.update(reply.info)
        self.info["is_correct"] = bool(reply.info.get("is_correct", reply.reward > 0))
        if reply.done and reply.final_reward is not None:  # rLLM: the final reward replaces the last step's
            step.reward = reply.final_reward
        await self.agent_call(self.agent.update_from_env, reply.observation, reply.reward, reply.done, reply.info)
        truncated = gen.finish_reason == "length"
        if reply.done:  # a cut-off final answer is marked so the trainer can filter overlong samples
            return TR.RESPONSE_TRUNCATION if truncated else TR.ENV_DONE
        if truncated and spent == TR.RESPONSE_TRUNCATION:  # the trajectory's token budget is spent
            return TR.RESPONSE_TRUNCATION
        return None

    def check_agent_output(self, action: Any, step: Any) -> None:
        agent = type(self.agent).__name__
        if not isinstance(action, Action):
            raise TypeError(f"{agent}.update_from_model returned {type(action).__name__}; it must return an "
                            "Action (shared.sdk.agent.Action), e.g. `return Action(action=response)`")
        if not isinstance(step, Step):
            raise TypeError(f"{agent}.get_current_state() returned {type(step).__name__} after update_from_model; "
                            "update_from_model must append a Step to the agent's trajectory")

    def response_budget(self, prompt_ids: list[int]) -> tuple[int, TR | None]:
        """This call's max_tokens, and how the episode ends when a budget tighter than max_response_tokens binds:
        with nothing left (max_tokens <= 0) it ends now; with a response cut by the trajectory's budget it ends
        after the step (RESPONSE_TRUNCATION). A response cut by the context window goes on: the next prompt
        decides (an agent may shorten its history)."""
        cfg, n = self.cfg, len(prompt_ids)
        if n > cfg.max_prompt_tokens and not self.agent.trajectory.steps:
            return 0, TR.PROMPT_TRUNCATION
        room = cfg.context_room(n)
        if room is not None and room < 1:
            return 0, TR.CONTEXT_EXCEEDED
        budget, spent = cfg.max_response_tokens, None
        if cfg.max_trajectory_tokens is not None and cfg.max_trajectory_tokens - n < budget:
            budget = cfg.max_trajectory_tokens - n
            spent = TR.PROMPT_TRUNCATION if budget <= 0 else TR.RESPONSE_TRUNCATION
        if room is not None and room < budget:
            budget, spent = room, None
        return budget, spent

    async def generate(self, prompt_ids: list[int], max_tokens: int):
        start = time.perf_counter()
        sampling = self.r.ctx.sampling(self.r.task.greedy)
        gen = await traced_generate(self.r.ctx.engine, prompt_ids, sampling, max_tokens, max(self.r.time_left(), 0.001))
        self.timings["gen_s"] += time.perf_counter() - start
        GEN_SECONDS.observe(time.perf_counter() - start)
        TOKENS.labels("prompt").inc(len(prompt_ids))
        TOKENS.labels("response").inc(len(gen.ids))
        return gen

    async def env_call(self, op: str, **kwargs: Any) -> EnvReply:
        start = time.perf_counter()
        timeout = self.cfg.env_step_timeout_s
        reply = await self.r.envs.call(
            op, self.session_id, run_id=self.r.task.run_id, env=self.env_name, owner=self.owner,
            env_args=self.env_args, timeout_s=timeout,
            ttl_s=self.cfg.trajectory_timeout_s + 2 * timeout + 60, **kwargs)
        self.timings["env_s"] += time.perf_counter() - start
        if reply.closed:  # the env worker closed the finished session itself
            self.owner = None
        if not reply.ok and reply.error_kind == "session_lost":
            raise EnvSessionLost(reply.error or "env session lost")
        return reply

    def env_failure(self, reply: EnvReply, op: str) -> TR:
        self.info["error"] = reply.error
        self.info["error_kind"] = reply.error_kind
        self.info["error_source"] = f"env {self.env_name}.{op}"
        if reply.error_kind == "infra":  # the env's sandbox failed: never scored
            return TR.INFRA_ERROR
        return TR.ENV_TIMEOUT if reply.error_kind == "timeout" else TR.ERROR

    def finish(self, reason: TR) -> Trajectory:
        traj = self.agent.trajectory
        traj.name, traj.task, traj.termination_reason = self.name, self.task, reason
        traj.reward = float(sum(s.reward for s in traj.steps))
        traj.info.update(self.info)
        traj.info.update({k: round(v, 4) for k, v in self.timings.items()})
        # malformed tool calls the env answered with an error observation (ToolEnv.call_tool): a per-run count
        if errors := sum(int(s.info.get("tool_call_errors", 0) or 0) for s in traj.steps if isinstance(s.info, dict)):
            traj.info["tool_call_errors"] = errors
        traj.info.setdefault("is_correct", False)
        return traj
