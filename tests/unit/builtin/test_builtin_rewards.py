import pytest

from services.env_worker.builtin import rewards
from services.env_worker.builtin.rewards import (
    countdown_reward,
    last_boxed,
    math_reward,
    normalize_answer,
    search_reward,
)


def test_last_boxed_handles_nesting_and_takes_the_last():
    assert last_boxed("\\boxed{1} then \\boxed{\\frac{a}{b}}") == "\\frac{a}{b}"
    assert last_boxed("no answer") is None


@pytest.mark.parametrize("given,truth", [
    ("5", "5"), ("x = 5", "5"), ("1,000", "1000"), ("\\dfrac{1}{2}", "\\frac{1}{2}"), ("3.0", "3"), ("\\text{ 7 }", "7"),
])
def test_normalization_matches_equivalent_strings(given, truth):
    assert normalize_answer(given) == normalize_answer(truth)


def test_math_reward_uses_answer_after_think():
    task = {"ground_truth": "4"}
    assert math_reward(task, "<think>maybe \\boxed{4}</think> so \\boxed{5}").reward == 0.0
    assert math_reward(task, "<think>maybe \\boxed{5}</think> so \\boxed{4}").is_correct
    assert math_reward(task, "<think>never finished \\boxed{4}").reward == 0.0
    assert math_reward(task, "the answer is 4").metadata["reason"].startswith("no \\boxed")


def test_missing_ground_truth_is_a_clear_error():
    with pytest.raises(ValueError, match="ground_truth"):
        rewards.ground_truths({"question": "?"})


def test_countdown_reward():
    task = {"nums": [3, 5, 7], "target": 22}
    assert countdown_reward(task, "<answer>3 * 5 + 7</answer>").is_correct
    assert countdown_reward(task, "\\boxed{(3 * 5) + 7 = 22}").is_correct
    assert countdown_reward(task, "<answer>3 * 7 + 1</answer>").reward == 0.0  # wrong numbers
    assert countdown_reward(task, "<answer>__import__('os')</answer>").reward == 0.0
    assert countdown_reward(task, "<answer>7 * 5 - 3</answer>").reward == 0.0  # 32


def test_countdown_reward_never_raises_on_huge_numbers():
    task = {"nums": [3, 5, 7], "target": 22}
    out = countdown_reward(task, f"<answer>{'1' * 5000} + 3</answer>")
    assert out.reward == 0.0 and "exactly once" in out.metadata["reason"]
    assert countdown_reward(task, f"<answer>{'(' * 300}3 * 5 + 7{')' * 300}</answer>").reward == 0.0


def test_search_reward_exact_match_and_f1():
    task = {"answer": ["The Eiffel Tower"]}
    assert search_reward(task, "<answer>eiffel tower</answer>").reward == 1.0
    partial = search_reward(task, "<answer>the tower in paris</answer>", metric="f1")
    assert 0 < partial.reward < 1 and not partial.is_correct
    assert search_reward(task, "<answer>Paris</answer>").reward == 0.0
