"""The code and tool envs driven through the registry, the way an env worker builds them, running the model's
programs in their sandbox (real processes: bubblewrap by default)."""

import uuid

import pytest

from shared.contracts.registry import resolve


def build(name: str, task: dict, **args):
    return resolve("env", name).from_dict({**task, **args})


def test_tool_env_runs_python_tool_then_grades_answer():
    env = build("tool", {"question": "What is 6*7?", "ground_truth": "42"})
    obs, _ = env.reset()
    assert obs["tools"][0]["function"]["name"] == "python"
    obs, reward, done, _ = env.step({"tool_calls": [{"name": "python", "arguments": {"code": "print(6*7)"}}]})
    assert obs["tool_outputs"][0]["content"].strip() == "42" and not done
    obs, _, _, _ = env.step({"tool_calls": [{"name": "python", "arguments": {"code": "while True: pass"}}]})
    assert obs["tool_outputs"][0]["content"].startswith("Error")
    obs, _, _, _ = env.step({"tool_calls": [{"name": "rm", "arguments": {}}]})
    assert "unknown tool" in obs["tool_outputs"][0]["content"]
    _, reward, done, _ = env.step("so \\boxed{42}")
    assert (reward, done) == (1.0, True)


def test_code_env_passes_and_fails_with_feedback():
    task = {"question": "Write add(a, b).", "tests": "assert add(1, 2) == 3\nassert add(-1, 1) == 0"}
    good = "```python\ndef add(a, b):\n    return a + b\n```"
    bad = "```python\ndef add(a, b):\n    return a - b\n```"
    env = build("code", task)
    env.reset()
    assert env.step(good)[1:3] == (1.0, True)
    env = build("code", task, max_turns=2)
    env.reset()
    obs, reward, done, _ = env.step(bad)
    assert reward == 0.0 and not done and "AssertionError" in obs["feedback"]
    assert env.step(good)[1] == 1.0


def test_code_env_survives_hostile_solution():
    env = build("code", {"tests": "assert True"})
    env.reset()
    _, reward, done, info = env.step("```python\nimport os\nwhile True: os.fork()\n```")
    assert (reward, done) == (0.0, True) and "Resource temporarily unavailable" in info["error"]
    assert info["sandbox"] == "namespaces"  # the default: a kernel boundary, its process limit stopped the bomb


@pytest.mark.parametrize("exit_call", ["import sys\nsys.exit(0)", "import os\nos._exit(0)"])
def test_code_env_does_not_reward_exiting_before_the_tests(exit_call):
    env = build("code", {"tests": "assert add(1, 2) == 3"})
    env.reset()
    _, reward, done, info = env.step(f"```python\ndef add(a, b):\n    return 0\n{exit_call}\n```")
    assert (reward, done, info["is_correct"]) == (0.0, True, False) and "did not run to their end" in info["error"]


def test_code_env_judges_input_output_cases_outside_the_sandbox():
    cases = [{"input": "1 2\n", "output": "3"}, {"input": "-1 1\n", "output": "0\n"}]
    env = build("code", {"question": "Print the sum of two integers read from stdin.", "tests": cases}, max_turns=2)
    obs, _ = env.reset()
    assert "tests" not in obs and obs["question"].startswith("Print the sum")  # the cases stay hidden
    obs, reward, done, info = env.step("```python\na, b = map(int, input().split())\nprint(a - b)\n```")
    assert (reward, done, info["is_correct"]) == (0.0, False, False)
    assert "case 1: wrong output for input '1 2\\n': got '-1\\n'" in obs["feedback"]
    assert env.step("```python\na, b = map(int, input().split())\nprint(a + b)   \n```")[1:3] == (1.0, True)


def test_an_input_output_solution_cannot_find_the_expected_output():
    """The expected outputs never enter the sandbox: a probe that searches everything it can read (its files,
    its source, stdin, argv, environment, /tmp, /proc) for the exact answer does not find it. The probe is told
    the answer in two halves, so its own source does not hold it whole. It skips the Python installation and
    site-packages: public read-only code that cannot hold this test's fresh secret, and, bound at its real path,
    a checkout's venv lies under /tmp for a checkout there, too large to read within the sandbox's time limit."""
    secret = f"answer-{uuid.uuid4().hex}"
    search = (f"import os, sys\nneedle = {secret[:16]!r} + {secret[16:]!r}\n"
              "seen = [sys.stdin.read(), ' '.join(sys.argv), str(dict(os.environ))]\n"
              "python = tuple(os.path.realpath(p) for p in {sys.prefix, sys.base_prefix, sys.exec_prefix})\n"
              "for root in ('.', '/tmp', '/proc/self', '/proc/1'):\n"
              "    for d, dirs, files in os.walk(root):\n"
              "        if os.path.realpath(d).startswith(python) or '/site-packages' in d:\n"
              "            dirs[:] = []\n"
              "            continue\n"
              "        for f in files:\n"
              "            try:\n"
              "                seen.append(open(os.path.join(d, f), errors='ignore').read(1 << 20))\n"
              "            except Exception:\n"
              "                pass\n"
              "found = 'FOUND' if any(needle in s for s in seen) else 'NOT FOUND'\n"
              "print(found)\nprint(found, file=sys.stderr)\n")
    env = build("code", {"tests": [{"input": "q", "output": secret}]}, max_turns=2)
    env.reset()
    obs, reward, _, _ = env.step(f"```python\n{search}```")
    assert reward == 0.0 and "got 'NOT FOUND\\n'" in obs["feedback"], obs
    # The same search does find an answer that travels with the program, as assert tests do.
    env = build("code", {"tests": f"assert {secret!r} == input()"}, max_turns=2)
    env.reset()
    obs, reward, _, _ = env.step(f"```python\n{search}```")
    assert reward == 0.0 and "\nFOUND" in obs["feedback"], obs


def test_code_and_tool_envs_take_the_sandbox_mode_from_their_args():
    env = build("code", {"tests": "assert True", "sandbox": "none"})
    env.reset()
    assert env.step("```python\nimport os\nos.fork()\n```")[3]["sandbox"] == "none"  # the audit hook refused
    with pytest.raises(ValueError, match="unknown sandbox mode 'off'"):
        build("code", {"tests": "assert True", "sandbox": "off"})
    tool = build("tool", {"question": "q", "ground_truth": "1", "sandbox": "none"})
    assert tool.tools["python"].sandbox == "none"
