"""Reward functions for the built-in environments: `fn(task, response) -> RewardOutput`.

Math grading (rLLM's rule): take the last `\\boxed{}` after `</think>`, compare it with the ground truth by
normalized string match, then by symbolic equivalence (math-verify on sympy). The symbolic check ALWAYS runs
in a separate grader process under a hard time limit: a pathological expression (`9^{9^{9^9}}`) gets the
grader killed and the answer counted wrong, instead of hanging the env worker (rLLM's known defect).
"""

from __future__ import annotations

import ast
import json
import queue
import re
import select
import string
import subprocess
import sys
import threading
from collections import Counter
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any

THINK_END = "</think>"
GRADING_TIMEOUT_S = 5.0
GRADER_START_TIMEOUT_S = 60.0


@dataclass
class RewardOutput:
    reward: float
    is_correct: bool
    metadata: dict[str, Any] = field(default_factory=dict)


# -- answer extraction ---------------------------------------------------------------------------------------
def last_boxed(text: str) -> str | None:
    """Content of the last \\boxed{...} (or \\fbox{...}), braces balanced; None if there is none."""
    start = max(text.rfind("\\boxed{"), text.rfind("\\fbox{"))
    if start < 0:
        return None
    i = text.index("{", start)
    depth = 0
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i + 1 : j]
    return None


def final_answer_text(response: str) -> str | None:
    """The part of a response that may hold the answer: after </think> when thinking was used.

    An unterminated <think> block has no answer (the model never finished thinking)."""
    if THINK_END in response:
        return response.rsplit(THINK_END, 1)[1]
    if "<think>" in response:
        return None
    return response


_PLAIN_NUMBER = re.compile(r"-?\d+(\.\d+)?")
_STRIP = ["\\left", "\\right", "\\!", "\\,", "\\;", "\\:", "$", "\\displaystyle"]


def normalize_answer(s: str) -> str:
    s = s.strip()
    for token in _STRIP:
        s = s.replace(token, "")
    s = re.sub(r"\\text\{\s*([^}]*)\}", r"\1", s)
    s = s.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac").replace("^\\circ", "").replace("^{\\circ}", "")
    s = re.sub(r"\s+", "", s).rstrip(".")
    s = re.sub(r"^[a-zA-Z]\s*=", "", s)  # "x=5" -> "5"
    if re.fullmatch(r"-?\d+\.0+", s):
        s = s.split(".")[0]
    return s.replace(",", "") if re.fullmatch(r"-?[\d,]+", s) else s


# -- symbolic grading in a killable child process ------------------------------------------------------------
def serve_grader() -> None:
    """The grader child: `python -m shared.builtin.rewards`; JSON lines [given, truth] in, true/false out."""
    from math_verify import parse, verify

    print("ready", flush=True)
    for line in sys.stdin:
        given, truth = json.loads(line)
        try:
            ok = bool(verify(parse(f"\\boxed{{{truth}}}"), parse(f"\\boxed{{{given}}}")))
        except Exception:
            ok = False
        print(json.dumps(ok), flush=True)


class _Grader:
    """One math-verify child process. Killed (and lazily restarted) when a check overruns its limit."""

    def __init__(self):
        self.proc: subprocess.Popen | None = None

    def check(self, given: str, truth: str, timeout_s: float) -> bool | None:
        """True/False, or None when the check timed out (the child is killed)."""
        self._ensure_started()
        self.proc.stdin.write(json.dumps([given, truth]) + "\n")
        self.proc.stdin.flush()
        line = self._readline(timeout_s)
        if line is None:
            self.stop()
            return None
        return json.loads(line)

    def _readline(self, timeout_s: float) -> str | None:
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout_s)
        return self.proc.stdout.readline() if ready else None

    def _ensure_started(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            return
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "shared.builtin.rewards"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            text=True, bufsize=1,
        )
        if self._readline(GRADER_START_TIMEOUT_S) != "ready\n":
            self.stop()
            raise RuntimeError("math grader process did not start")

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
        self.proc = None


class GraderPool:
    """A few grader processes shared by the threads of one worker."""

    def __init__(self, size: int = 2):
        self.idle: queue.Queue[_Grader] = queue.Queue()
        for _ in range(size):
            self.idle.put(_Grader())

    def equivalent(self, given: str, truth: str, timeout_s: float = GRADING_TIMEOUT_S) -> bool | None:
        grader = self.idle.get()
        try:
            return grader.check(given, truth, timeout_s)
        finally:
            self.idle.put(grader)


_pool: GraderPool | None = None
_pool_lock = threading.Lock()


def grader_pool() -> GraderPool:
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = GraderPool()
        return _pool


def symbolic_equal(given: str, truth: str, timeout_s: float = GRADING_TIMEOUT_S) -> bool | None:
    return grader_pool().equivalent(given, truth, timeout_s)


# -- reward functions ----------------------------------------------------------------------------------------
def ground_truths(task: dict) -> list[str]:
    for key in ("ground_truth", "answer", "solution"):
        if task.get(key) is not None:
            value = task[key]
            return [str(v) for v in value] if isinstance(value, list) else [str(value)]
    raise ValueError("math task needs a 'ground_truth' (or 'answer') field with the reference answer")


def math_reward(task: dict, response: str, *, timeout_s: float = GRADING_TIMEOUT_S) -> RewardOutput:
    text = final_answer_text(response)
    answer = last_boxed(text) if text is not None else None
    if answer is None:
        return RewardOutput(0.0, False, {"reason": "no \\boxed{} answer after </think>"})
    given = normalize_answer(answer)
    truths = [t if last_boxed(t) is None else last_boxed(t) for t in ground_truths(task)]
    if any(given == normalize_answer(t) for t in truths):
        return RewardOutput(1.0, True, {"answer": answer, "match": "string"})
    if _PLAIN_NUMBER.fullmatch(given) and all(_PLAIN_NUMBER.fullmatch(normalize_answer(t)) for t in truths):
        # Two plain decimals are equal or not: exact comparison, no round trip to the symbolic grader.
        ok = any(Fraction(given) == Fraction(normalize_answer(t)) for t in truths)
        return RewardOutput(float(ok), ok, {"answer": answer, "match": "numeric"} if ok else {"answer": answer})
    for truth in truths:
        verdict = symbolic_equal(answer, truth, timeout_s)
        if verdict is None:
            return RewardOutput(0.0, False, {"answer": answer, "reason": "grading timed out"})
        if verdict:
            return RewardOutput(1.0, True, {"answer": answer, "match": "symbolic"})
    return RewardOutput(0.0, False, {"answer": answer})


_COUNTDOWN_CHARS = re.compile(r"^[\d\s+\-*/().]+$")


def countdown_answer(response: str) -> str | None:
    text = final_answer_text(response) or ""
    tagged = re.findall(r"<answer>(.*?)</answer>", text, re.S)
    expr = tagged[-1] if tagged else last_boxed(text)
    return expr.split("=")[0].strip() if expr else None


def _eval_arith(expr: str) -> float:
    """Evaluate + - * / over numbers only (the AST is checked; no names, calls or powers)."""
    tree = ast.parse(expr, mode="eval")
    allowed = (ast.Expression, ast.BinOp, ast.UnaryOp, ast.Constant, ast.Add, ast.Sub, ast.Mult, ast.Div,
               ast.USub, ast.UAdd)
    if not all(isinstance(node, allowed) for node in ast.walk(tree)):
        raise ValueError("only + - * / and numbers are allowed")
    return eval(compile(tree, "<countdown>", "eval"), {"__builtins__": {}})


def countdown_reward(task: dict, response: str) -> RewardOutput:
    """1 if the expression uses each of task['nums'] exactly once and equals task['target']."""
    expr = countdown_answer(response)
    if not expr or not _COUNTDOWN_CHARS.match(expr):
        return RewardOutput(0.0, False, {"reason": "no arithmetic expression in <answer></answer> or \\boxed{}"})
    used = sorted(int(n) for n in re.findall(r"\d+", expr))
    if used != sorted(int(n) for n in task["nums"]):
        return RewardOutput(0.0, False, {"expression": expr, "reason": "must use each number exactly once"})
    try:
        value = _eval_arith(expr)
    except (SyntaxError, ValueError, ZeroDivisionError) as e:
        return RewardOutput(0.0, False, {"expression": expr, "reason": f"invalid expression: {e}"})
    correct = abs(value - float(task["target"])) < 1e-6
    return RewardOutput(float(correct), correct, {"expression": expr, "value": value})


def normalize_text(s: str) -> str:
    """SQuAD answer normalization: lower case, no punctuation, no articles, single spaces."""
    s = "".join(ch for ch in s.lower() if ch not in set(string.punctuation))
    return " ".join(w for w in s.split() if w not in ("a", "an", "the"))


def f1_score(prediction: str, truth: str) -> float:
    pred, gold = normalize_text(prediction).split(), normalize_text(truth).split()
    common = sum((Counter(pred) & Counter(gold)).values())
    if common == 0:
        return 0.0
    precision, recall = common / len(pred), common / len(gold)
    return 2 * precision * recall / (precision + recall)


def search_answer(response: str) -> str | None:
    text = final_answer_text(response) or ""
    tagged = re.findall(r"<answer>(.*?)</answer>", text, re.S)
    return tagged[-1].strip() if tagged else last_boxed(text)


def search_reward(task: dict, response: str, *, metric: str = "em") -> RewardOutput:
    """Exact match (metric="em", reward 0/1) or token F1 (metric="f1") against any reference answer."""
    answer = search_answer(response)
    if answer is None:
        return RewardOutput(0.0, False, {"reason": "no answer in <answer></answer> or \\boxed{}"})
    truths = ground_truths(task)
    em = max(float(normalize_text(answer) == normalize_text(t)) for t in truths)
    f1 = max(f1_score(answer, t) for t in truths)
    return RewardOutput(em if metric == "em" else f1, em == 1.0, {"answer": answer, "em": em, "f1": f1})


if __name__ == "__main__":
    serve_grader()
