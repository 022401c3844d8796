"""Every built-in env driven through the registry, the way an env worker builds it: from_dict(task | args)."""

import json

import pytest

from services.jobs.builtin_datasets import generate
from services.rollout_worker.builtin.agents import (
    CodeAgent,
    FrozenLakeAgent,
    MathAgent,
    ToolAgent,
    parse_tool_calls,
)
from shared.contracts.registry import resolve


def build(name: str, task: dict, **args):
    return resolve("env", name).from_dict({**task, **args})


def test_math_env_single_turn():
    task = generate("arithmetic", 1, seed=3)[0]
    env = build("math", task)
    obs, _ = env.reset()
    assert obs["question"] == task["question"]
    _, reward, done, info = env.step(f"\\boxed{{{task['ground_truth']}}}")
    assert (reward, done, info["is_correct"]) == (1.0, True, True)
    assert build("math", task).step("\\boxed{nonsense}")[1] == 0.0


def test_math_env_rejects_task_without_reference():
    with pytest.raises(ValueError, match="ground_truth"):
        build("math", {"question": "1+1?"})


def test_countdown_env_grades_a_generated_task():
    task = generate("countdown", 1, seed=0)[0]
    expr = f"{task['nums'][0]} + {task['nums'][1]} + {task['nums'][2]}"
    env = build("countdown", {**task, "target": sum(task["nums"])})
    env.reset()
    assert env.step(f"\\boxed{{{expr}}}")[1] == 1.0


def test_frozenlake_reaches_goal_and_counts_invalid_moves():
    env = build("frozenlake", {"map": ["SF", "FG"], "seed": 0})
    obs, _ = env.reset()
    assert obs["grid"].startswith("P")
    obs, reward, done, info = env.step("Jump")
    assert info["invalid"] and not done and reward == 0.0
    _, reward, done, _ = env.step("Right")
    assert not done
    _, reward, done, info = env.step("Down")
    assert (reward, done, info["is_correct"]) == (1.0, True, True)


def test_frozenlake_hole_ends_episode_without_reward():
    env = build("frozenlake", {"map": ["SH", "FG"]})
    env.reset()
    _, reward, done, _ = env.step("Right")
    assert done and reward == 0.0


def test_frozenlake_generated_maps_have_start_and_goal():
    rows = generate("frozenlake", 3, seed=1)
    assert all(r["map"][0][0] == "S" and r["map"][-1][-1] == "G" for r in rows)
    assert rows == generate("frozenlake", 3, seed=1)


def test_tool_env_finish_tool_ends_and_grades_the_episode():
    env = build("tool", {"question": "What is 6*7?", "ground_truth": "42"})
    obs, _ = env.reset()
    assert [t["function"]["name"] for t in obs["tools"]] == ["python", "finish"]
    finish = {"name": "finish", "arguments": {"response": "It is \\boxed{42}"}}
    # finish ends the turn: the python call beside it is not run, the answer is graded, the episode is done
    obs, reward, done, info = env.step({"tool_calls": [{"name": "python", "arguments": {"code": "1/0"}}, finish]})
    assert (obs, reward, done) == ({}, 1.0, True)
    assert info["is_correct"] and info["finished_by"] == "finish_tool"
    env = build("tool", {"question": "What is 6*7?", "ground_truth": "42"})
    env.reset()
    _, reward, done, info = env.step({"tool_calls": [{"name": "finish", "arguments": {"response": "\\boxed{41}"}}]})
    assert (reward, done, info["is_correct"]) == (0.0, True, False)


@pytest.mark.parametrize("arguments", [None, {}, {"response": 42}, "\\boxed{42}"])
def test_tool_env_malformed_finish_scores_zero_and_ends(arguments):
    env = build("tool", {"question": "What is 6*7?", "ground_truth": "42"})
    env.reset()
    _, reward, done, info = env.step({"tool_calls": [{"name": "finish", "arguments": arguments}]})
    assert (reward, done) == (0.0, True) and info["verdict"] == "no_answer"


def test_search_env_offers_finish_too():
    env = build("search", {"question": "Where is the Colosseum?", "answer": "Rome", "corpus": CORPUS})
    obs, _ = env.reset()
    assert obs["tools"][-1]["function"]["name"] == "finish"
    _, reward, done, _ = env.step({"tool_calls": [{"name": "finish", "arguments": {"response": "<answer>Rome</answer>"}}]})
    assert (reward, done) == (1.0, True)


@pytest.mark.parametrize("tests", [[{"input": "1"}], [{"input": 1, "output": "1"}], {"input": "", "output": "1"}])
def test_code_env_says_what_is_wrong_with_malformed_cases(tests):
    with pytest.raises(ValueError, match="must be assert statements .* or a list of"):
        build("code", {"tests": tests})


CORPUS = [
    {"title": "Eiffel Tower", "text": "The Eiffel Tower is in Paris and was completed in 1889."},
    {"title": "Big Ben", "text": "Big Ben is the nickname of the great bell in London."},
    {"title": "Colosseum", "text": "The Colosseum is an amphitheatre in Rome."},
]


def test_search_env_bm25_and_em_reward(tmp_path):
    env = build("search", {"question": "Where is the Colosseum?", "answer": "Rome", "corpus": CORPUS})
    obs, _ = env.reset()
    assert obs["tools"][0]["function"]["name"] == "search" and "corpus" not in obs
    obs, _, done, _ = env.step({"tool_calls": [{"name": "search", "arguments": {"query": "Colosseum"}}]})
    assert "Rome" in obs["tool_outputs"][0]["content"].split("\n")[0] and not done
    assert env.step("<answer>Rome</answer>")[1] == 1.0
    path = tmp_path / "corpus.jsonl"
    path.write_text("\n".join(json.dumps(d) for d in CORPUS))
    env = build("search", {"question": "q", "answer": "the great bell"}, corpus_path=str(path), metric="f1")
    env.reset()
    assert 0 < env.step("<answer>great bell London</answer>")[1] < 1


def test_math_agent_builds_messages_and_steps():
    agent = MathAgent()
    agent.update_from_env({"question": "1+1?"}, 0.0, False, {})
    assert agent.chat_completions[-1]["role"] == "user" and "\\boxed{}" in agent.chat_completions[-1]["content"]
    action = agent.update_from_model("<think>easy</think> \\boxed{2}")
    assert action.action.endswith("\\boxed{2}") and agent.trajectory.steps[-1].thought == "<think>easy"
    agent.update_from_env({}, 0.0, False, {})
    assert "mistake" in agent.chat_completions[-1]["content"]


def test_tool_agent_parses_qwen_tool_calls():
    text = 'ok <tool_call>\n{"name": "python", "arguments": {"code": "print(1)"}}\n</tool_call>' \
           '<tool_call>{not json}</tool_call>'
    calls = parse_tool_calls(text)
    assert calls[0] == {"name": "python", "arguments": {"code": "print(1)"}}
    assert calls[1]["name"] == "invalid_tool_call"
    agent = ToolAgent()
    agent.update_from_env({"question": "q", "tools": [{"type": "function", "function": {"name": "python"}}]},
                          0, False, {})
    assert "<tools>" in agent.chat_completions[0]["content"]
    assert agent.update_from_model(text).action["tool_calls"][0]["name"] == "python"
    agent.update_from_env({"tool_outputs": [{"name": "python", "content": "1"}]}, 0, False, {})
    assert agent.chat_completions[-1] == {"role": "tool", "content": "1"}
    assert agent.update_from_model("\\boxed{1}").action == "\\boxed{1}"


def test_frozenlake_and_code_agents_parse_actions():
    agent = FrozenLakeAgent()
    agent.update_from_env({"grid": "PF\nFG"}, 0, False, {})
    assert agent.update_from_model("I go \\boxed{down}").action == "Down"
    assert agent.update_from_model("hmm").action == "invalid"
    code = CodeAgent()
    code.update_from_env({"question": "add"}, 0, False, {})
    code.update_from_env({"feedback": "failed"}, 0, False, {})
    assert code.chat_completions[-1]["content"].startswith("failed")


def test_generators_are_deterministic_and_checked():
    assert generate("arithmetic", 5, seed=1) == generate("arithmetic", 5, seed=1)
    assert generate("arithmetic", 5, seed=1) != generate("arithmetic", 5, seed=2)
    row = generate("countdown", 1, seed=4)[0]
    assert eval(" + ".join(map(str, row["nums"]))) is not None and "target" in row
    with pytest.raises(ValueError, match="unknown built-in dataset"):
        generate("nope", 1)


def play_digits(task: dict, policy) -> tuple[float, list[bool], list[str]]:
    """One episode of the digits env: `policy(turn, words said so far)` answers; (reward, right per turn, words)."""
    env = build("digits", task)
    words, right = [env.reset()[0]["word"]], []
    while True:
        obs, reward, done, info = env.step(policy(len(right), words))
        right.append(info["correct"])
        if done:
            return reward, right, words
        assert reward == 0.0  # the reward comes only at the end
        words.append(obs["word"])


def test_digits_env_rewards_at_the_end_and_its_words_follow_the_answers():
    from services.env_worker.builtin.envs import NUMBER_WORDS

    task = generate("digits", 1, seed=1)[0]
    digit = lambda word: str(NUMBER_WORDS.index(word))  # noqa: E731
    reward, right, words = play_digits(task, lambda t, words: digit(words[-1]))
    assert (reward, right, len(words)) == (1.0, [True, True, True], 3)
    for i, offset in enumerate(task["offsets"]):  # the next word: the answer + the turn's secret offset
        assert NUMBER_WORDS.index(words[i + 1]) == (NUMBER_WORDS.index(words[i]) + offset) % 10
    wrong = play_digits(task, lambda t, words: str((int(digit(words[-1])) + 1) % 10) if t == 1 else digit(words[-1]))
    assert wrong[:2] == (2 / 3, [True, False, True]) and wrong[2][2] != words[2]  # another answer, another word
    assert play_digits({**task, "all_or_nothing": True}, lambda t, w: digit(w[-1]) if t != 1 else "x")[0] == 0.0
    with pytest.raises(ValueError, match="offsets"):
        build("digits", {"first": "one"})


def test_digits_env_is_not_solved_by_ignoring_the_env_or_by_reading_only_the_first_word():
    from services.env_worker.builtin.envs import NUMBER_WORDS

    rows = generate("digits", 200, seed=0)
    digit = lambda word: str(NUMBER_WORDS.index(word))  # noqa: E731
    constant = max(sum(play_digits(r, lambda t, w, d=d: d)[0] for r in rows) / len(rows) for d in "0123456789")
    assert constant == pytest.approx(0.1, abs=0.02)  # 1/10 per turn in expectation; the best of ten digits
    first_only = sum(play_digits(r, lambda t, w: digit(w[0]))[0] for r in rows) / len(rows)
    assert 0.3 < first_only < 0.5  # the first turn right, later ones by chance (an offset of 0)


def test_digits_curriculum_rows_have_the_lengths_asked_and_the_default_rows_are_unchanged():
    mixed = generate("digits", 400, seed=0, lengths=[1, 8])
    lengths = [len(r["offsets"]) + 1 for r in mixed]
    assert set(lengths) == {1, 8} and 150 < lengths.count(1) < 250  # each length about half the rows
    assert generate("digits", 20, seed=3) == generate("digits", 20, seed=3, turns=3, lengths=None)
    assert all(len(r["offsets"]) == 2 for r in generate("digits", 20, seed=3))
    with pytest.raises(ValueError, match="lengths must be >= 1"):
        generate("digits", 5, lengths=[0, 3])


def test_the_registry_names_every_env_that_runs_model_code():
    """The run config gives these envs a `sandbox` arg from the registry's list, without importing them."""
    from shared.contracts.registry import ENVS, MODEL_CODE_ENVS, resolve

    assert {name for name in ENVS if getattr(resolve("env", name), "runs_model_code", False)} == MODEL_CODE_ENVS


def test_malformed_tool_calls_are_observations_and_counted():
    """Not JSON, an unknown tool, arguments that are not an object, miss a required one or name one the tool does
    not take: each answered with an error observation saying what was wrong, counted in `tool_call_errors`; the
    episode goes on (a tool that runs is not called: no sandbox here)."""
    env = build("tool", {"question": "What is 6*7?", "ground_truth": "42"})
    env.reset()
    calls = [{"name": "invalid_tool_call", "arguments": {}, "error": "Expecting value: line 1 column 1"},
             {"name": "rm", "arguments": {}}, {"name": "python", "arguments": ["print(1)"]},
             {"name": "python", "arguments": {}}, {"name": "python", "arguments": {"code": "1", "timeout": 3}}]
    obs, reward, done, info = env.step({"tool_calls": calls})
    texts = [o["content"] for o in obs["tool_outputs"]]
    assert (reward, done, info["num_tool_calls"], info["tool_call_errors"]) == (0.0, False, 5, 5)
    assert "not valid JSON (Expecting value" in texts[0] and "<tool_call>" in texts[0]
    assert "unknown tool 'rm'; available: python, finish" in texts[1]
    assert texts[2] == "Error: tool arguments must be a JSON object"
    assert "wrong arguments for python (missing: code); it takes code" in texts[3]
    assert "wrong arguments for python (not taken: timeout)" in texts[4]
    _, reward, done, _ = env.step("so \\boxed{42}")  # the episode still ends as the model decides
    assert (reward, done) == (1.0, True)
