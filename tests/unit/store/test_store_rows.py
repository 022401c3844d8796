"""The store's row tuples line up with TABLES, which is derived from the models: a column added to a model without
its value in the row builders (or in another place) fails here, not as a wrong value in Postgres."""

from __future__ import annotations

import uuid

from services.controller.store import TABLES, build_rows
from shared.contracts.db.models import EpisodeRow, StepRow, TokenArrayRow, TrajectoryRow
from shared.contracts.messages import EpisodeResult, TrajectoryRecord, TrajectoryStep


def test_tables_are_the_models_columns_the_store_writes():
    for model in (EpisodeRow, TrajectoryRow, StepRow, TokenArrayRow):
        written = [c for c, _ in TABLES[model.__tablename__]]
        assert written == [c.name for c in model.__table__.columns if c.name != "created_at"]
    assert dict(TABLES["token_arrays"])["logprobs"] == "real[]" and dict(TABLES["episodes"])["reward"] == "float8"


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
    assert named["steps"][0]["weight_version"] == 7 and named["steps"][0]["reward"] == 0.25
    assembled = [a for a in named["token_arrays"] if a["step_idx"] == -1][0]
    assert (assembled["response_ids"], assembled["loss_mask"], assembled["versions"]) == ([3], [1], [7])
