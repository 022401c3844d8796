"""The store's row tuples line up with TABLES, which is derived from the models: a column added to a model without
its value in the row builders (or in another place) fails here, not as a wrong value in Postgres."""

from __future__ import annotations

import uuid

from services.controller.store import TABLES, build_rows
from shared.contracts.db.models import EpisodeRow, StepRecordRow, TokenStreamRow, TrajectoryRow
from shared.contracts.messages import EpisodeResult, TrajectoryRecord, TrajectoryStep
from tests.support.multi_turn import multi_turn


def test_tables_are_the_models_columns_the_store_writes():
    for model in (EpisodeRow, TrajectoryRow, StepRecordRow, TokenStreamRow):
        written = [c for c, _ in TABLES[model.__tablename__]]
        assert written == [c.name for c in model.__table__.columns if c.name != "created_at"]
    assert dict(TABLES["token_streams"])["logprobs"] == "real[]" and dict(TABLES["episodes"])["reward"] == "float8"


def test_row_values_sit_under_their_column_names():
    step = TrajectoryStep(prompt_ids=[1, 2], response_ids=[3], logprobs=[-0.5], model_response="ok", reward=0.25,
                      weight_version=7)
    traj = TrajectoryRecord(uid="u1", name="solver", reward=0.5, termination_reason="env_done", steps=[step],
                            prompt_ids=[1, 2], response_ids=[3], loss_mask=[1], logprobs=[-0.5], versions=[7])
    result = EpisodeResult(run_id=str(uuid.uuid4()), task_id="t9", sample_idx=2, attempt=1, status="completed",
                           termination_reason="env_done", reward=0.75, batch_idx=4, trajectories=[traj],
                           worker_id="w1")
    rows = build_rows([result])
    named = {t: [dict(zip([c for c, _ in TABLES[t]], r, strict=True)) for r in rows[t]] for t in TABLES}
    episode, trajectory = named["episodes"][0], named["trajectories"][0]
    assert (episode["task_id"], episode["sample_idx"], episode["attempt"]) == ("t9", 2, 1)
    assert (episode["reward"], episode["batch_idx"], episode["worker_id"]) == (0.75, 4, "w1")
    assert (trajectory["episode_id"], trajectory["name"], trajectory["reward"]) == (episode["id"], "solver", 0.5)
    assert named["step_records"][0]["weight_version"] == 7 and named["step_records"][0]["reward"] == 0.25
    assembled = [a for a in named["token_streams"] if a["step_idx"] == -1][0]
    assert (assembled["response_ids"], assembled["loss_mask"], assembled["versions"]) == ([3], [1], [7])


def rows_of(traj: TrajectoryRecord) -> dict[str, list[dict]]:
    result = EpisodeResult(run_id=str(uuid.uuid4()), task_id="t", sample_idx=0, status="completed",
                           termination_reason="env_done", trajectories=[traj])
    rows = build_rows([result])
    return {t: [dict(zip([c for c, _ in TABLES[t]], r, strict=True)) for r in rows[t]] for t in TABLES}


def test_a_multi_turn_trajectory_stores_its_stream_once_and_each_message_once():
    named = rows_of(multi_turn(8))
    assert [a["step_idx"] for a in named["token_streams"]] == [-1]  # no step's arrays stored beside the stream
    steps = named["step_records"]
    assert all(s["tokens_in_stream"] for s in steps) and {s["chat_from"] for s in steps} == {0}
    added = [[m["content"] for m in s["chat_added"].obj] for s in steps]
    assert added[0] == ["q", "turn 0"] and added[1:] == [[f"obs {k - 1}", f"turn {k}"] for k in range(1, 8)]
    assert [s["prompt_tokens"] for s in steps] == [3 + 5 * k for k in range(8)]


def test_a_rewritten_chat_starts_over_and_an_off_stream_step_is_stored_whole():
    traj = multi_turn(6, rewrite_at=3, off_stream=4)
    named = rows_of(traj)
    steps = {s["step_idx"]: s for s in named["step_records"]}
    assert [steps[k]["chat_from"] for k in range(6)] == [0, 0, 0, 3, 3, 3]
    assert steps[3]["chat_added"].obj == traj.steps[3].chat_completions  # whole: it does not extend step 2's
    assert [k for k in range(6) if not steps[k]["tokens_in_stream"]] == [4]
    whole = [a for a in named["token_streams"] if a["step_idx"] == 4]
    assert [(a["prompt_ids"], a["response_ids"], a["logprobs"]) for a in whole] == \
        [(traj.steps[4].prompt_ids, traj.steps[4].response_ids, traj.steps[4].logprobs)]
