"""The multi-turn demo's judgement (tests/support/demo_multiturn.py): a policy that learned only some turns fails it."""

from tests.support.demo_multiturn import BAR, TURNS, judge, summarize


def sql_rows(accuracy_by_turn: list[float], versions=range(12), num: int = 100):
    """SQL-shaped rows of a policy that answers turn t right with probability accuracy_by_turn[t]."""
    turns = [{"version": v, "turn": t, "num": num, "right_answers": round(num * a)}
             for v in versions for t, a in enumerate(accuracy_by_turn)]
    rewards = [{"version": v, "num": num, "reward": num * sum(accuracy_by_turn) / TURNS, "mixed_versions": 3}
               for v in versions]
    return turns, rewards


def test_learning_every_turn_passes_and_learning_only_the_first_fails():
    learned = summarize(*sql_rows([0.95, 0.9, 0.9])) | {"versions_hot_reloaded": 11, "wall_s": 300}
    assert learned["per_turn_accuracy"] == [0.95, 0.9, 0.9] and learned["episodes_with_two_versions"] == 36
    first_turn = summarize(*sql_rows([1.0, 0.1, 0.1])) | {"versions_hot_reloaded": 11, "wall_s": 300}
    assert judge(learned | {"initial_reward": 0.02}) == []
    failures = judge(first_turn | {"initial_reward": 0.02})
    assert any("final reward" in f for f in failures) and any("{2: 0.1, 3: 0.1}" in f for f in failures)
    # even a reward over the bar fails while one turn stays weak
    assert any("turns answered" in f for f in judge(learned | {"per_turn_accuracy": [1.0, 1.0, 0.5],
                                                               "initial_reward": 0.02}))
    assert BAR["initial_reward_max"] <= 0.2
