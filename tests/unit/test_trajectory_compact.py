"""The compact wire form of a trajectory (`TrajectoryRecord.compact`): linear in the trajectory's length, and
`expanded()` gives back exactly the whole steps, through the codec too."""

from __future__ import annotations

from shared.contracts.messages import EpisodeResult, decode, encode
from shared.contracts.messages.codec import entry_bytes
from tests.support.multi_turn import multi_turn


def through_the_wire(traj):
    msg = EpisodeResult(run_id="r", task_id="t", sample_idx=0, status="completed", termination_reason="env_done",
                        trajectories=[traj])
    fields = encode(msg)
    return decode(fields).trajectories[0], entry_bytes(fields)


def test_compact_then_expanded_is_the_whole_trajectory():
    whole = multi_turn(10, rewrite_at=4, off_stream=6)
    compact = whole.compact()
    assert [s.chat_from for s in compact.steps] == [None, 0, 0, 0, 4, 4, 4, 4, 4, 4]
    assert [s.stream_slice is not None for s in compact.steps] == [False] + [k != 6 for k in range(1, 10)]
    assert compact.steps[4].chat_completions == whole.steps[4].chat_completions  # begun anew: whole
    assert compact.steps[2].chat_completions == whole.steps[2].chat_completions[-2:]  # what it added
    expanded, sent_whole = through_the_wire(compact)[0].expanded(), through_the_wire(whole)[0]
    for a, b in zip(expanded.steps, sent_whole.steps, strict=True):
        assert (a.chat_completions, a.prompt_ids, a.response_ids) == (b.chat_completions, b.prompt_ids, b.response_ids)
        assert a.logprobs == b.logprobs  # float32 on the wire, either way
        assert (a.chat_from, a.stream_slice) == (None, None)
    assert whole.expanded() == whole  # whole already: unchanged
    assert compact.compact() == compact  # compact already: unchanged


def test_the_compact_message_grows_linearly_with_turns():
    """Bytes per turn of the whole message grow with the turn count (each step carries the context so far); the
    compact one's stay flat."""
    per_turn = {n: [through_the_wire(t)[1] / n for t in (multi_turn(n), multi_turn(n).compact())] for n in (8, 32)}
    whole_growth, compact_growth = (per_turn[32][i] / per_turn[8][i] for i in (0, 1))
    assert whole_growth > 2.0 and compact_growth < 1.2, per_turn
