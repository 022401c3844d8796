"""The demo's task and its bar (tests/support/recall.py, tests/support/demo.py): the answer depends on the prompt, and the
judgement of a run rejects a policy that ignores it."""

import time
from collections import Counter

import pytest

from tests.support.demo import BAR, judge, summarize, watch
from tests.support.recall import ANSWERS, CHANCE, WORDS, RecallEnv, dataset_rows


def test_every_question_is_asked_equally_and_the_best_constant_answer_scores_chance():
    rows = dataset_rows(200)
    assert Counter(r["question"] for r in rows) == {w: 20 for w in WORDS}
    assert {r["question"]: r["answer"] for r in rows} == ANSWERS
    best = max(sum(RecallEnv(r).step(digit)[1] for r in rows) / len(rows) for digit in map(str, range(10)))
    assert best == CHANCE <= 0.3
    assert dataset_rows(30)[:10] == dataset_rows(10)  # a row does not depend on how many are asked for


def test_env_rewards_exactly_the_digit_and_refuses_a_row_without_an_answer():
    env = RecallEnv({"question": "seven", "answer": "7"})
    assert env.reset()[0] == "seven"
    assert [env.step(a)[1] for a in ("7", " 7\n", "77", "seven", "", None)] == [1.0, 1.0, 0.0, 0.0, 0.0, 0.0]
    with pytest.raises(ValueError, match="answer"):
        RecallEnv({"question": "seven"})


def test_an_offset_variant_wants_digit_plus_offset_and_the_plain_answer_scores_nothing():
    task = {"question": "seven", "answer": "7"}
    env = RecallEnv.from_dict(task | {"offset": 3})
    env.reset()
    assert env.step("0")[1] == 1.0  # (7 + 3) mod 10
    assert RecallEnv.from_dict(task | {"offset": 3}).step("7")[1] == 0.0
    assert task["answer"] == "7"  # the row itself is left as it is


def rows_of(policy, versions, num=16):
    """SQL-shaped rows (question, answer, version, num, reward) of a policy: question -> answer."""
    return [{"question": q, "answer": policy(q, v), "version": v, "num": num,
             "reward": num * float(policy(q, v) == ANSWERS[q])} for v in versions for q in WORDS]


def test_a_constant_answer_fails_the_bar_and_shows_as_one_digit_everywhere():
    result = summarize(rows_of(lambda q, v: "7", range(12))) | {"versions_hot_reloaded": 11, "wall_s": 60}
    assert result["final_reward"] == pytest.approx(0.1)
    assert set(result["answer_by_question"].values()) == {"7"}
    failures = judge(result)
    assert any("final reward" in f for f in failures)
    (per_question,) = [f for f in failures if "questions answered right" in f]
    assert "'seven'" not in per_question.split("never")[0]  # the one question the constant answer gets right


def test_a_high_mean_with_questions_left_unlearned_fails_on_per_question_accuracy():
    learned = set(WORDS[:8])  # 80% of questions right, two always wrong
    result = summarize(rows_of(lambda q, v: ANSWERS[q] if v > 0 and q in learned else "0", range(12)))
    result |= {"versions_hot_reloaded": 11, "wall_s": 60}
    assert result["final_reward"] >= BAR["final_reward_min"]
    (failure,) = judge(result)
    assert "'eight': 0.0" in failure and "'nine': 0.0" in failure


def test_one_question_left_unlearned_fails_the_bar():
    learned = set(WORDS[:9])
    result = summarize(rows_of(lambda q, v: ANSWERS[q] if v > 0 and q in learned else "0", range(12)))
    result |= {"versions_hot_reloaded": 11, "wall_s": 60}
    (failure,) = judge(result)
    assert "'nine': 0.0" in failure


def test_a_run_that_learns_every_question_through_enough_versions_passes():
    result = summarize(rows_of(lambda q, v: ANSWERS[q] if v >= 5 else "0", range(14)))
    assert result["initial_reward"] == pytest.approx(0.1)
    assert judge(result | {"versions_hot_reloaded": 13, "wall_s": 60}) == []
    assert "hot-reloaded" in judge(result | {"versions_hot_reloaded": 9, "wall_s": 60})[0]


def test_the_readme_training_example_is_the_demo_run_on_the_builtin_recall_task():
    """examples/train_recall_grpo.yaml (the README's first training run) trains as `make demo` does, with the
    registered `recall` agent, env and generator."""
    import yaml

    from services.jobs.builtin_datasets import generate
    from shared.contracts.registry import resolve
    from shared.contracts.run_config import RunConfig
    from tests.support.demo import ALGORITHM, LR, SAMPLES, STEPS, TASKS, demo_config

    example = yaml.safe_load(open("examples/train_recall_grpo.yaml"))
    RunConfig.model_validate(example)
    demo = demo_config(example["model"], STEPS, TASKS, SAMPLES, LR, max_staleness=1)
    same = ("model", "samples_per_task", "tasks_per_batch", "max_prompt_tokens", "max_response_tokens",
            "max_staleness", "total_steps", "max_in_flight", "sampling", "engine")
    assert {k: example[k] for k in same} == {k: demo[k] for k in same} | {"model": example["model"]}
    assert example["algorithm"] == ALGORITHM | {"lr": LR}
    assert resolve("env", example["env"]["name"]) is RecallEnv and example["dataset"] == "recall"
    rows = generate("recall", 30, seed=1)
    assert [r["question"] for r in rows] == [r["question"] for r in dataset_rows(30, seed=1)]
    assert all(RecallEnv.from_dict(r).step(r["answer"])[1] == 1.0 for r in rows) and len({r["id"] for r in rows}) == 30


def test_the_time_is_not_judged_and_a_demo_says_when_its_wall_clock_limit_ends_the_wait():
    result = summarize(rows_of(lambda q, v: ANSWERS[q] if v >= 2 else "x", range(12)))
    assert judge(result | {"versions_hot_reloaded": 11, "wall_s": 5000}) == []  # slow on a loaded machine: learned

    class Api:  # a run still training at version 37 of 100 when the limit passes
        def get(self, path):
            body = {"data": []} if path.endswith("/rewards") else {"policy_version": 37, "status": "running"}
            return type("Response", (), {"json": lambda self: body})()

    lines: list[str] = []
    watch(Api(), "r", 100, time.monotonic() + 0.2, lines.append)
    assert "at version 37 of 100: the wall-clock limit (DEMO_TIMEOUT_S) passed while the run was running" in lines[-1]
