"""A multi-turn trajectory assembled the way rollout workers assemble one, for the store's tests."""

from __future__ import annotations

from shared.contracts.messages import TrajectoryRecord, TrajectoryStep


def multi_turn(turns: int, rewrite_at: int | None = None, off_stream: int | None = None) -> TrajectoryRecord:
    """A trajectory whose turns extend one context, assembled the way rollout workers do: each step's prompt
    is the stream so far, its response the next ids, the env's reply (masked, logprob 0) between turns. The
    chat restarts (a summary) at `rewrite_at`; step `off_stream`'s prompt is retokenized (not the stream's)."""
    prompt, response, mask, logprobs, steps, chat = [1, 2, 3], [], [], [], [], [{"role": "user", "content": "q"}]
    for k in range(turns):
        ids, lps = [100 + 10 * k + j for j in range(3)], [-0.5 - k - j / 10 for j in range(3)]
        if k == rewrite_at:
            chat = [{"role": "user", "content": f"summary of {k} turns"}]
        chat = chat + [{"role": "assistant", "content": f"turn {k}"}]
        step_prompt = prompt + response if k != off_stream else [9] + prompt + response
        steps.append(TrajectoryStep(prompt_ids=step_prompt, response_ids=ids, logprobs=lps, chat_completions=chat,
                                    model_response=f"turn {k}"))
        response, mask, logprobs = response + ids, mask + [1] * 3, logprobs + lps
        if k < turns - 1:
            chat = chat + [{"role": "tool", "content": f"obs {k}"}]
            response, mask, logprobs = response + [7, 8], mask + [0, 0], logprobs + [0.0, 0.0]
    return TrajectoryRecord(uid="u", steps=steps, prompt_ids=prompt, response_ids=response, loss_mask=mask,
                            logprobs=logprobs, versions=[0] * len(response))
