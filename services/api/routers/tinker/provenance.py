"""stable_reinforce's inputs from what the rollout workers recorded: each span of a datum's targets that its
provenance says was sampled is checked against the stored sample it names (the same tokens) and trained against
that sample's own logprobs, as the sampler computed them. A sequence id `<request id>:<i>` is the stored episode
with task id `<request id>` and sample index `i`, in one of the key's own runs. More: docs/tinker.md"""

from __future__ import annotations

import time

from sqlalchemy import and_, select
from sqlalchemy.orm import Session

from services.api.errors import ApiError
from services.api.tinker_proto import SampledSpan
from shared.contracts.db.models import EpisodeRow, Run, TokenArrayRow, TrajectoryRow
from shared.contracts.messages import TinkerDatum
from shared.contracts.tinker_run import parse_sequence_id

RECORD_WAIT_S = 30.0  # how long an answered sample may take to reach Postgres (the store writes it asynchronously)


def recorded_samples(db: Session, tinker, owner: str, ids: set[str], wait_s: float = RECORD_WAIT_S
                     ) -> dict[str, tuple[list[int], list[float]]]:
    """The stored samples of `ids` among the key's own: sequence id -> (tokens, logprobs). Those not stored yet
    are waited for up to `wait_s` when their request is the key's and answered (the rollout worker hands samples
    to the store before it answers); any other is missing at once."""
    found = stored_samples(db, owner, ids)
    waiting = {sid for sid in ids - found.keys()
               if (parsed := parse_sequence_id(sid)) and answered_sample(tinker, owner, parsed[0])}
    deadline = time.monotonic() + wait_s
    while waiting and time.monotonic() < deadline:
        time.sleep(0.2)
        more = stored_samples(db, owner, waiting)
        found |= more
        waiting -= more.keys()
    return found


def answered_sample(tinker, owner: str, request_id: str) -> bool:
    future = tinker.future(owner, request_id) or {}
    return future.get("result", {}).get("type") == "sample"


def stored_samples(db: Session, owner: str, ids: set[str]) -> dict[str, tuple[list[int], list[float]]]:
    wanted = {parsed: sid for sid in ids if (parsed := parse_sequence_id(sid))}
    if not wanted:
        return {}
    own_runs = select(Run.id).where(Run.kind == "tinker", Run.config["owner"].astext == owner)
    query = (select(EpisodeRow.task_id, EpisodeRow.sample_idx, TokenArrayRow.response_ids, TokenArrayRow.logprobs)
             .join(TrajectoryRow, TrajectoryRow.episode_id == EpisodeRow.id)
             .join(TokenArrayRow, and_(TokenArrayRow.trajectory_id == TrajectoryRow.id, TokenArrayRow.step_idx == -1))
             .where(EpisodeRow.run_id.in_(own_runs), EpisodeRow.task_id.in_({r for r, _ in wanted})))
    rows = db.execute(query).all()
    db.rollback()  # ends the read: nothing held open while waiting
    return {wanted[(t, i)]: (list(tokens), list(logprobs)) for t, i, tokens, logprobs in rows if (t, i) in wanted}


def with_recorded_logprobs(data: list[TinkerDatum], spans: list[list[SampledSpan]],
                           recorded: dict[str, tuple[list[int], list[float]]]) -> list[TinkerDatum]:
    """Each datum with the sampler's recorded logprobs at its sampled positions and `weights` 1 there, 0 elsewhere
    (the positions stable_reinforce trains); 400 naming the span when its sample is not the key's or not stored,
    or when its tokens are not the sample's."""
    out = []
    for i, (datum, runs) in enumerate(zip(data, spans, strict=True)):
        logprobs = list(datum.logprobs or [0.0] * len(datum.target_tokens))
        weights = [0.0] * len(datum.target_tokens)
        for j, span in enumerate(runs):
            field = f"forward_backward_input.data[{i}].loss_fn_input_spans[{j}]"
            if span.sequence_id not in recorded:
                raise ApiError(400, f"sequence {span.sequence_id!r} is not a stored sample of this key's", field=field,
                               hint="name the sequence_id a sample of this key returned (SampledSequence.sequence_id)")
            tokens, sampled = recorded[span.sequence_id]
            end = span.offset + span.length
            claimed = datum.target_tokens[span.start:span.start + span.length]
            if end > len(tokens) or tokens[span.offset:end] != claimed:
                raise ApiError(400, f"targets {span.start}..{span.start + span.length - 1} are not tokens "
                               f"{span.offset}..{end - 1} of sequence {span.sequence_id!r} as it was sampled",
                               field=field, hint="a sampled span reproduces its sample's tokens, in order")
            logprobs[span.start:span.start + span.length] = sampled[span.offset:end]
            weights[span.start:span.start + span.length] = [1.0] * span.length
        out.append(datum.model_copy(update={"logprobs": logprobs, "weights": weights}))
    return out
