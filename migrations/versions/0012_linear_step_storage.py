"""Storage linear in a trajectory's length. A step stored its whole prompt's token ids and the whole chat so
far, so a 32-turn episode stored its context ~16 times over, twice. Now `step_records` (was `steps`) stores the
messages a step added (`chat_added`, from step `chat_from` on) and `token_streams` (was `token_arrays`) the
assembled stream once, plus the arrays of steps that are not a slice of it (`tokens_in_stream` false). The views
`steps` and `token_arrays` rebuild the old rows, so every query written against them reads the same. Rows
already there are kept whole (chat_from = step_idx, tokens not in the stream).

Revision ID: 0012_linear_step_storage
Revises: 0011_ledger_published_at
"""

import sqlalchemy as sa
from alembic import op

revision = "0012_linear_step_storage"
down_revision = "0011_ledger_published_at"
branch_labels = None
depends_on = None

READER = "flywheel_reader"

STEP_COLUMNS = ("observation, thought, action, model_response, reward, done, mc_return, info, weight_version, "
                "prompt_tokens, response_tokens, gen_ms, env_ms")

# A step's chat: the messages added by the steps from chat_from to it, in order.
STEPS_VIEW = f"""
CREATE VIEW steps AS
SELECT s.trajectory_id, s.step_idx,
       (SELECT coalesce(jsonb_agg(m.msg ORDER BY p.step_idx, m.ord), '[]'::jsonb)
          FROM step_records p CROSS JOIN LATERAL jsonb_array_elements(p.chat_added) WITH ORDINALITY AS m(msg, ord)
         WHERE p.trajectory_id = s.trajectory_id AND p.step_idx BETWEEN s.chat_from AND s.step_idx)
       AS chat_completions,
       {", ".join("s." + c for c in STEP_COLUMNS.split(", "))}
  FROM step_records s
"""

# A step in the stream: its prompt is the stream's first prompt_tokens ids, its response the next
# response_tokens, its logprobs the same positions of the stream's logprobs (aligned to response_ids).
STREAM_STEPS = """
SELECT s.trajectory_id, s.step_idx,
       (a.prompt_ids || a.response_ids)[1:s.prompt_tokens] AS prompt_ids,
       (a.prompt_ids || a.response_ids)[s.prompt_tokens + 1:s.prompt_tokens + s.response_tokens] AS response_ids,
       a.logprobs[s.prompt_tokens - cardinality(a.prompt_ids) + 1:
                  s.prompt_tokens - cardinality(a.prompt_ids) + s.response_tokens] AS logprobs
  FROM step_records s JOIN token_streams a ON a.trajectory_id = s.trajectory_id AND a.step_idx = -1
 WHERE s.tokens_in_stream
"""

TOKEN_ARRAYS_VIEW = f"""
CREATE VIEW token_arrays AS
SELECT trajectory_id, step_idx, prompt_ids, response_ids, logprobs, loss_mask, versions FROM token_streams
UNION ALL
SELECT trajectory_id, step_idx, prompt_ids, response_ids, logprobs, NULL::smallint[], NULL::integer[]
  FROM ({STREAM_STEPS}) AS stream_steps
"""


def _grant_reader() -> None:
    op.execute(f"DO $$ BEGIN IF EXISTS (SELECT 1 FROM pg_roles WHERE rolname = '{READER}') THEN "
               f"GRANT SELECT ON steps, token_arrays, step_records, token_streams TO {READER}; END IF; END $$;")


def upgrade() -> None:
    op.rename_table("steps", "step_records")
    op.execute("ALTER INDEX steps_pkey RENAME TO step_records_pkey")
    op.execute("ALTER TABLE step_records RENAME CONSTRAINT steps_trajectory_id_fkey TO step_records_trajectory_id_fkey")
    op.alter_column("step_records", "chat_completions", new_column_name="chat_added")
    op.add_column("step_records", sa.Column("chat_from", sa.Integer(), nullable=False, server_default="0"))
    op.add_column("step_records", sa.Column("tokens_in_stream", sa.Boolean(), nullable=False,
                                            server_default=sa.false()))
    op.execute("UPDATE step_records SET chat_from = step_idx")
    op.alter_column("step_records", "chat_from", server_default=None)
    op.alter_column("step_records", "tokens_in_stream", server_default=None)
    op.rename_table("token_arrays", "token_streams")
    op.execute("ALTER INDEX token_arrays_pkey RENAME TO token_streams_pkey")
    op.execute("ALTER TABLE token_streams RENAME CONSTRAINT token_arrays_trajectory_id_fkey "
               "TO token_streams_trajectory_id_fkey")
    op.execute(STEPS_VIEW)
    op.execute(TOKEN_ARRAYS_VIEW)
    _grant_reader()


def downgrade() -> None:
    # every step whole again: its arrays stored, its whole chat in its own row (the update reads the rows as they
    # were before it: a statement never sees its own changes)
    op.execute(f"INSERT INTO token_streams (trajectory_id, step_idx, prompt_ids, response_ids, logprobs) "
               f"{STREAM_STEPS}")
    op.execute("UPDATE step_records r SET chat_added = v.chat_completions FROM steps v "
               "WHERE v.trajectory_id = r.trajectory_id AND v.step_idx = r.step_idx AND r.chat_from <> r.step_idx")
    op.execute("DROP VIEW token_arrays")
    op.execute("DROP VIEW steps")
    op.execute("ALTER INDEX token_streams_pkey RENAME TO token_arrays_pkey")
    op.execute("ALTER TABLE token_streams RENAME CONSTRAINT token_streams_trajectory_id_fkey "
               "TO token_arrays_trajectory_id_fkey")
    op.rename_table("token_streams", "token_arrays")
    op.drop_column("step_records", "tokens_in_stream")
    op.drop_column("step_records", "chat_from")
    op.alter_column("step_records", "chat_added", new_column_name="chat_completions")
    op.execute("ALTER INDEX step_records_pkey RENAME TO steps_pkey")
    op.execute("ALTER TABLE step_records RENAME CONSTRAINT step_records_trajectory_id_fkey TO steps_trajectory_id_fkey")
    op.rename_table("step_records", "steps")
