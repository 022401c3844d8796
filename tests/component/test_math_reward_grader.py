"""The math reward through its symbolic grader, a process of its own: equivalent forms score, a pathological
expression is refused instead of hanging, plain numbers never reach the grader."""

from services.env_worker.builtin.rewards import math_reward


def test_math_reward_symbolic_equivalence():
    out = math_reward({"ground_truth": "0.5"}, "\\boxed{\\frac{1}{2}}")
    assert out.is_correct and out.metadata["match"] == "symbolic"
    assert not math_reward({"ground_truth": "0.5"}, "\\boxed{\\frac{1}{3}}").is_correct


def test_pathological_expression_is_rejected_instead_of_hanging():
    out = math_reward({"ground_truth": "1"}, "\\boxed{9^{9^{9^{9}}}}")
    assert out.reward == 0.0 and out.metadata["verdict"] in ("rejected", "timeout")
    # the grader is still there: grading still works afterwards
    assert math_reward({"ground_truth": "2"}, "\\boxed{4/2}", timeout_s=30).is_correct


def test_plain_numbers_are_compared_exactly_without_the_symbolic_grader():
    assert math_reward({"ground_truth": "2.5"}, "\\boxed{2.50}").metadata["match"] == "numeric"
    wrong = math_reward({"ground_truth": "-48"}, "so \\boxed{-47}")
    assert wrong.reward == 0.0 and "match" not in wrong.metadata
    # Not both plain decimals: still decided symbolically.
    assert math_reward({"ground_truth": "0.5"}, "\\boxed{\\frac{1}{2}}").metadata["match"] == "symbolic"
