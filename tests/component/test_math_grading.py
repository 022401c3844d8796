"""Math grading: equivalent forms, percent, exact decimals, huge numbers and expensive expressions.

The case table lives in tests/support/grading.py (which also times every case into bench/results/grading.json)."""

import sys

import pytest

from services.env_worker.builtin import rewards
from services.env_worker.builtin.rewards import GRADING_TIMEOUT_S, math_reward
from tests.support.grading import CASES

ADVERSARIAL = [c for c in CASES if c[4] == "rejected"]
# Verdicts here must not depend on how loaded the machine is: a generous limit for the table, the real one
# for the adversarial cases below.
GENEROUS_S = 30.0


@pytest.mark.parametrize("name,response,truth,correct,verdict", CASES, ids=[c[0] for c in CASES])
def test_grading_case(name, response, truth, correct, verdict, record_property):
    out = math_reward({"ground_truth": truth}, response, timeout_s=GENEROUS_S)
    record_property("grading_s", out.metadata["grading_s"])  # per-case time, in the junit report
    assert out.is_correct == correct, out.metadata
    assert out.reward == float(correct)
    if verdict is not None:
        assert out.metadata["verdict"] == verdict, out.metadata


def test_the_table_is_large_and_covers_every_class():
    assert len(CASES) >= 50
    names = " ".join(c[0] for c in CASES)
    for word in ("fraction", "mixed", "interval", "set", "matrix", "units", "thousands", "unicode", "degrees",
                 "scientific", "text", "think", "percent", "repeated", "pi", "sqrt2", "5000 digits", "tower",
                 "factorial", "nested"):
        assert word in names, word


@pytest.mark.parametrize("name,response,truth,correct,verdict", ADVERSARIAL, ids=[c[0] for c in ADVERSARIAL])
def test_adversarial_answers_score_zero_under_the_real_limit(name, response, truth, correct, verdict):
    """Under the default 1 s limit every expensive answer ends as a rejection or a timeout, never an error."""
    out = math_reward({"ground_truth": truth}, response)
    assert out.reward == 0.0 and out.metadata["verdict"] in ("rejected", "timeout"), out.metadata


@pytest.mark.parametrize("answer", ["1+" * 300 + "1", "(" * 40 + "1" + ")" * 40, "9" * 5000])
def test_oversized_answers_are_rejected_without_a_grader(answer, monkeypatch):
    def no_grader():
        raise AssertionError("symbolic grading was reached")

    monkeypatch.setattr(rewards, "grader_pool", no_grader)
    out = math_reward({"ground_truth": "\\frac{1}{3}"}, f"\\boxed{{{answer}}}")
    assert out.metadata["verdict"] == "rejected" and out.reward == 0.0


def test_numbers_past_the_int_string_limit_never_raise():
    assert sys.get_int_max_str_digits() < 5000
    huge = "1" * 5000
    for truth in ("1", "\\frac{1}{3}", huge, "x"):
        out = math_reward({"ground_truth": truth}, f"\\boxed{{{huge}}}")
        assert out.is_correct == (truth == huge)
    assert math_reward({"ground_truth": huge}, f"\\boxed{{{huge[:-1]}2}}").reward == 0.0


def test_digits_bound_accepts_competition_answers_and_rejects_towers():
    from math_verify import parse

    def digits(latex):
        return rewards.digits_bound(parse(f"\\boxed{{{latex}}}", parsing_timeout=None)[0])

    for fine in ("2^{2023}", "1000!", "10^{100}", "\\binom{20}{10}", "(x+1)^{20}", "\\frac{2^{100}}{3^{50}}"):
        assert digits(fine) <= rewards.MAX_DIGITS, fine
    for huge in ("9^{9^{9^9}}", "(10!)!", "2^{10^{5}}", "100000!", "x^{10^{9}}"):
        assert digits(huge) > rewards.MAX_DIGITS, huge


def test_decimals_become_exact_fractions():
    assert rewards.exact_latex("0.333") == "\\frac{333}{1000}"
    assert rewards.exact_latex("1.5e3") == "\\frac{15}{10}\\times10^{3}"
    assert rewards.exact_latex("(0.5, 2]") == "(\\frac{5}{10}, 2]"
    assert rewards.exact_latex("50\\%") == "50"


def test_grader_interrupts_itself_at_its_soft_limit_and_keeps_serving():
    """The child's own timer ends a slow check (deeply nested fractions, sent past the screen) with a timeout
    verdict before the parent's limit, and the same process keeps serving."""
    from tests.support.grading import _nested_fractions

    pool = rewards.GraderPool(size=1)
    grader = pool.idle.queue[0]
    try:
        assert pool.grade("1", ["1"], timeout_s=GENEROUS_S) == {"verdict": "equal"}  # started and ready
        first = grader.proc
        slow = rewards.exact_latex(_nested_fractions(25))
        assert pool.grade(slow, ["1"], timeout_s=5.0) == {"verdict": "timeout"}  # no "killed" reason
        assert grader.proc is first and first.poll() is None
        assert pool.grade("\\frac{2}{4}", ["0.5"], timeout_s=GENEROUS_S) == {"verdict": "equal"}
    finally:
        grader.stop()


def test_grader_stuck_past_the_limit_is_killed_and_replaced():
    """A grader that does not answer in time (stuck in C code, where its own timer cannot interrupt it) is
    killed at the limit, the check is a timeout, and a replacement starts at once."""
    stuck = [sys.executable, "-c", "import sys, time\nprint('ready', flush=True)\nfor _ in sys.stdin: time.sleep(3600)"]
    pool = rewards.GraderPool(size=1, command=stuck)
    grader = pool.idle.queue[0]
    try:
        first = grader.proc
        verdict = pool.grade("1", ["1"], timeout_s=GRADING_TIMEOUT_S)
        assert verdict["verdict"] == "timeout" and "killed" in verdict["reason"]
        assert first.poll() is not None and grader.proc is not first and grader.proc.poll() is None
    finally:
        grader.stop()


def test_grader_that_dies_is_replaced():
    dies = [sys.executable, "-c", "import sys\nprint('ready', flush=True)\nsys.stdin.readline()\nsys.exit(3)"]
    pool = rewards.GraderPool(size=1, command=dies)
    grader = pool.idle.queue[0]
    try:
        first = grader.proc
        verdict = pool.grade("1", ["1"], timeout_s=GENEROUS_S)
        assert verdict["verdict"] == "wrong" and "exited" in verdict["reason"]
        assert grader.proc is not first and grader.proc.poll() is None
    finally:
        grader.stop()


def test_a_timeout_scores_zero_with_its_verdict():
    out = math_reward({"ground_truth": "(x+1)^2"}, "\\boxed{x^2+2x+1}", timeout_s=0.001)
    assert out.reward == 0.0 and out.metadata["verdict"] == "timeout"
    assert math_reward({"ground_truth": "(x+1)^2"}, "\\boxed{x^2+2x+1}", timeout_s=GENEROUS_S).is_correct


def test_grading_errors_score_zero_instead_of_raising(monkeypatch):
    def broken(*_args, **_kwargs):
        raise RuntimeError("grader crashed")

    monkeypatch.setattr(rewards, "_grade", broken)
    out = math_reward({"ground_truth": "1"}, "\\boxed{1}")
    assert out.reward == 0.0 and "grader crashed" in out.metadata["reason"]
