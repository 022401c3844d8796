"""One trajectory with its steps: messages, model response, action, observation, reward, token counts, and
its unit's timeline (dispatch, start, finish, store; the trace in Jaeger when tracing was on)."""

from __future__ import annotations

import uuid

from fastapi import APIRouter
from sqlalchemy import select

from services.api.deps import DB, Config
from services.api.errors import ApiError, errors
from services.api.routers.runs import trajectory_out
from services.api.schemas import TrajectoryDetail
from shared.contracts.db.models import EpisodeRow, RolloutTaskRow, StepRow, TokenArrayRow, TrajectoryRow

router = APIRouter(prefix="/trajectories", tags=["trajectories"])


def step_out(s: StepRow) -> dict:
    return {
        "step_idx": s.step_idx, "chat_completions": s.chat_completions, "observation": s.observation,
        "thought": s.thought, "action": s.action, "model_response": s.model_response, "reward": s.reward,
        "done": s.done, "mc_return": s.mc_return, "info": s.info, "weight_version": s.weight_version,
        "prompt_tokens": s.prompt_tokens, "response_tokens": s.response_tokens, "gen_ms": s.gen_ms,
        "env_ms": s.env_ms,
    }


def tokens_out(t: TokenArrayRow) -> dict:
    return {"step_idx": t.step_idx, "prompt_ids": t.prompt_ids, "response_ids": t.response_ids,
            "logprobs": t.logprobs, "loss_mask": t.loss_mask, "versions": t.versions}


def timeline_out(session, ep: EpisodeRow, jaeger_ui_url: str | None) -> dict:
    dispatched = session.get(RolloutTaskRow, (ep.run_id, ep.task_id, ep.sample_idx, ep.attempt))
    trace_id = (ep.info or {}).get("trace_id")
    return {"dispatched_at": dispatched.dispatched_at if dispatched else None, "started_at": ep.started_at,
            "finished_at": ep.finished_at, "stored_at": ep.created_at, "trace_id": trace_id,
            "trace_url": f"{jaeger_ui_url.rstrip('/')}/trace/{trace_id}" if trace_id and jaeger_ui_url else None}


@router.get("/{trajectory_id}", response_model=TrajectoryDetail, responses=errors(404, 422))
def show_trajectory(trajectory_id: uuid.UUID, session: DB, config: Config, include_tokens: bool = False) -> dict:
    """Turn by turn; `include_tokens=true` adds the token id / logprob arrays (large)."""
    t = session.get(TrajectoryRow, trajectory_id)
    if t is None:
        raise ApiError(404, f"trajectory {trajectory_id} does not exist", field="trajectory_id")
    ep = session.get(EpisodeRow, t.episode_id)
    steps = session.execute(select(StepRow).where(StepRow.trajectory_id == t.id).order_by(StepRow.step_idx))
    out = trajectory_out(t) | {
        "info": t.info, "uid": t.uid, "steps": [step_out(s) for s in steps.scalars()],
        "episode": {"id": ep.id, "status": ep.status, "is_correct": ep.is_correct, "reward": ep.reward,
                    "termination_reason": ep.termination_reason, "task": ep.task, "metrics": ep.metrics,
                    "error": ep.error, "worker_id": ep.worker_id} if ep else None,
        "timeline": timeline_out(session, ep, config.jaeger_ui_url) if ep else None,
    }
    if include_tokens:
        arrays = session.execute(select(TokenArrayRow).where(TokenArrayRow.trajectory_id == t.id)
                                 .order_by(TokenArrayRow.step_idx)).scalars()
        out["tokens"] = [tokens_out(a) for a in arrays]
    return out
