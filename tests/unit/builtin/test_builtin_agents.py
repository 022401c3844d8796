"""The built-in chat agents' history window (`keep_last_turns`)."""

import pytest

from services.rollout_worker.builtin.agents import DigitsAgent, FrozenLakeAgent


def test_keep_last_turns_keeps_the_system_prompt_and_the_newest_turns():
    agent = FrozenLakeAgent(keep_last_turns=2)
    for grid in ("a", "b", "c"):
        agent.update_from_env({"grid": grid}, 0.0, False, {})
        agent.update_from_model(f"reply to {grid}")
    roles = [(m["role"], m["content"]) for m in agent.chat_completions]
    assert roles[0][0] == "system"
    assert [c.split("\n")[1] if r == "user" else c for r, c in roles[1:]] == ["b", "reply to b", "c", "reply to c"]
    # every step recorded the history the model saw at that turn
    assert [len(s.chat_completions) for s in agent.trajectory.steps] == [3, 5, 5]


def test_without_a_window_the_history_only_grows():
    agent = DigitsAgent()
    for word in ("one", "two", "three"):
        agent.update_from_env({"word": word}, 0.0, False, {})
        agent.update_from_model("1")
    assert [m["content"] for m in agent.chat_completions if m["role"] == "user"] == ["one", "two", "three"]


@pytest.mark.parametrize("bad", [0, -1, "2", 1.5])
def test_a_bad_window_is_refused_with_what_to_pass(bad):
    with pytest.raises(ValueError, match="keep_last_turns must be a positive integer"):
        DigitsAgent(keep_last_turns=bad)
