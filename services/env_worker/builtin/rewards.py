"""Reward functions for the built-in environments: `fn(task, response) -> RewardOutput`.

Math grading (rLLM's rule): take the last boxed answer after `</think>`, compare it with the ground truth by
normalized string match, then by exact numeric match, then by symbolic equivalence (math-verify on sympy). Its
promises are tested in tests/component/test_math_grading.py: a decimal is the exact number it writes; percent,
degrees and units are units; answers too long, too deep or too large are "rejected" before symbolic work;
symbolic work never takes more than GRADING_TIMEOUT_S; grading never raises on what the policy wrote.
`metadata["verdict"]` says how a grading ended.

More: docs/reliability.md#math-grading
"""

from __future__ import annotations

import ast
import functools
import json
import math
import queue
import re
import select
import signal
import string
import subprocess
import sys
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from decimal import Decimal, InvalidOperation
from typing import Any

from shared.tasks.answers import THINK_END, final_answer_text, last_boxed  # noqa: F401  (graded here too)

GRADING_TIMEOUT_S = 1.0  # hard bound on one grading's symbolic work
GRADER_SOFT_FRACTION = 0.9  # the grader interrupts itself at this fraction of the bound, keeping its process
GRADER_START_TIMEOUT_S = 60.0
MAX_ANSWER_CHARS = 400  # or twice the longest reference, whichever is larger
MAX_NESTING = 6  # bracket depth: antlr's parse time grows fast with it (8 nested parentheses: ~1 s on a busy 2-core box)
MAX_DIGITS = 4000  # below Python's int-string limit (4300): anything larger cannot even be printed


@dataclass
class RewardOutput:
    reward: float
    is_correct: bool
    metadata: dict[str, Any] = field(default_factory=dict)


# -- normalization -------------------------------------------------------------------------------------------
_UNICODE = {"\u2212": "-", "\u2013": "-", "\u00b0": "^\\circ", "\u00d7": "\\times", "\u00b7": "\\cdot"}
_THOUSANDS = re.compile(r"[-+]?\d{1,3}(,\d{3})+(\.\d+)?")
_PLAIN_NUMBER = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?")
_STRIP = ["\\left", "\\right", "\\!", "\\,", "\\;", "\\:", "$", "\\displaystyle"]


def clean_answer(s: str) -> str:
    """What both grading paths see: unicode signs in LaTeX, no percent signs (a unit), no thousands commas."""
    for char, latex in _UNICODE.items():
        s = s.replace(char, latex)
    s = s.replace("\\%", "").replace("%", "").replace("{,}", ",").strip()
    return s.replace(",", "") if _THOUSANDS.fullmatch(s) else s


def normalize_answer(s: str) -> str:
    """The key for the string match: answers equal as written (up to spacing and notation) are correct."""
    s = clean_answer(s)
    for token in _STRIP:
        s = s.replace(token, "")
    s = re.sub(r"\\(?:text|textbf|mathrm)\{\s*([^}]*)\}", r"\1", s)
    s = s.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac").replace("^\\circ", "").replace("^{\\circ}", "")
    s = re.sub(r"\s+", "", s).rstrip(".")
    s = re.sub(r"^[a-zA-Z]\s*=", "", s)  # "x=5" -> "5"
    if re.fullmatch(r"-?\d+\.0+", s):
        s = s.split(".")[0]
    return clean_answer(s)


_SCIENTIFIC = re.compile(r"(?<![\w\\.])(\d+(?:\.\d+)?)[eE]([-+]?\d+)(?![\w.])")
_DECIMAL = re.compile(r"(?<![\w\\.])(\d*)\.(\d+)(?![\d.])")


def _decimal_as_fraction(m: re.Match) -> str:
    whole, frac = m.group(1), m.group(2)
    numerator = (whole + frac).lstrip("0") or "0"  # string work: no int conversion, no int-string limit
    return f"\\frac{{{numerator}}}{{1{'0' * len(frac)}}}"


def exact_latex(s: str) -> str:
    """The answer as math-verify gets it: `1.5e3` as `1.5\\times10^{3}` and every decimal as the exact fraction
    it writes (`0.333` -> `\\frac{333}{1000}`), so no float is ever compared by rounding."""
    s = _SCIENTIFIC.sub(r"\1\\times10^{\2}", clean_answer(s))
    return _DECIMAL.sub(_decimal_as_fraction, s)


def screen_answer(answer: str, truths: list[str]) -> str | None:
    """Why the answer is too big to hand to the symbolic grader, or None. Linear in the answer's length."""
    limit = max(MAX_ANSWER_CHARS, 2 * max(len(t) for t in truths))
    if len(answer) > limit:
        return f"answer has {len(answer)} characters (more than {limit})"
    depth = deepest = 0
    for char in answer:
        depth += 1 if char in "{([" else -1 if char in "})]" else 0
        deepest = max(deepest, depth)
    if deepest > MAX_NESTING:
        return f"brackets nested {deepest} deep (more than {MAX_NESTING})"
    return None


def plain_numbers_equal(given: str, truth: str) -> bool | None:
    """Exact comparison when both are plain decimal numbers (Decimal: no int-string limit); else None."""
    if not (_PLAIN_NUMBER.fullmatch(given) and _PLAIN_NUMBER.fullmatch(truth)):
        return None
    try:
        return Decimal(given) == Decimal(truth)
    except InvalidOperation:
        return None


# -- symbolic grading in a killable child process ------------------------------------------------------------
class _Deadline(BaseException):
    """Raised in the grader by its soft timer; a BaseException so library `except Exception` cannot eat it."""


def digits_bound(expr: Any) -> float:
    """Upper bound on the decimal digits of a number that evaluating `expr` would build (symbols count as one).

    Walks math-verify's parse tree, which is left unevaluated, so `9^{9^{9^9}}` costs four nodes here instead of
    a grader stuck in integer multiplication."""
    import sympy

    if isinstance(expr, sympy.MatrixBase):
        return max((digits_bound(e) for e in expr), default=0.0)
    if not isinstance(expr, sympy.Basic):
        return 0.0
    if isinstance(expr, sympy.Rational):
        return math.log10(max(abs(expr.p), expr.q, 2))
    if isinstance(expr, sympy.Pow):
        base, exponent = expr.args
        base_digits, exponent_digits = digits_bound(base), digits_bound(exponent)
        if exponent.free_symbols:
            return base_digits + exponent_digits
        return max(base_digits, 1.0) * max(_magnitude(exponent, exponent_digits), 1.0)
    if isinstance(expr, (sympy.factorial, sympy.factorial2, sympy.subfactorial, sympy.gamma, sympy.binomial)):
        n = _magnitude(expr.args[0], digits_bound(expr.args[0]))
        return n * math.log10(max(n, 2.0))
    parts = [digits_bound(a) for a in expr.args]
    if isinstance(expr, sympy.Mul):
        return sum(parts)
    return max(parts, default=1.0) + (1.0 if isinstance(expr, sympy.Add) else 0.0)


def _magnitude(number: Any, digits: float) -> float:
    """|number| as a float (inf when huge), exact for rationals, else from its digits bound."""
    import sympy

    if digits > 300:
        return math.inf
    return float(abs(number)) if isinstance(number, sympy.Rational) else 10.0 ** digits


def _grade_symbolic(given: str, truths: list[str]) -> dict:
    from math_verify import parse, verify

    parsed = parse(f"\\boxed{{{given}}}", parsing_timeout=None)
    if not parsed:
        return {"verdict": "wrong", "reason": "the answer does not parse"}
    digits = max(digits_bound(e) for e in parsed)
    if digits > MAX_DIGITS:
        return {"verdict": "rejected", "reason": f"answer would evaluate to ~{digits:.3g} digits (limit {MAX_DIGITS})"}
    for truth in truths:
        gold = _parse_reference(truth)
        if gold and _numbers_differ(gold[0], parsed[0]):
            continue
        # Decimals are exact fractions by now; numeric_precision=50 keeps verify's evalf check from calling
        # a difference of 1e-20 zero.
        if verify(gold, parsed, numeric_precision=50, timeout_seconds=None):
            return {"verdict": "equal"}
    return {"verdict": "wrong"}


@functools.lru_cache(maxsize=4096)
def _parse_reference(truth: str) -> list:
    """A reference's parse, kept: a group's samples all grade against the same one (antlr parses are slow)."""
    from math_verify import parse

    return parse(f"\\boxed{{{truth}}}", parsing_timeout=None)


def _numbers_differ(gold: Any, given: Any) -> bool:
    """Two plain numbers that differ in their first 30 digits: decided by evalf, before verify's simplify
    (which can take most of a second to tell `\\pi` from `3.14159`)."""
    import sympy

    try:
        if not all(isinstance(e, sympy.Expr) and e.is_number for e in (gold, given)):
            return False
        difference = sympy.N(gold - given, 30)
        return bool(difference.is_Number and abs(difference) > sympy.Float("1e-20"))
    except Exception:  # not decidable this way: verify decides
        return False


def _answer(request: dict) -> dict:
    try:
        signal.setitimer(signal.ITIMER_REAL, request["budget_s"] * GRADER_SOFT_FRACTION)
        try:
            return _grade_symbolic(request["given"], request["truths"])
        except Exception as e:  # whatever the policy wrote, the grader answers
            return {"verdict": "wrong", "reason": f"grading failed: {type(e).__name__}: {str(e)[:200]}"}
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
    except _Deadline:
        return {"verdict": "timeout"}


_WARM_UP = [("\\frac{1}{2}", ["0.5"]), ("(1,2]", ["(1, 2]"]), ("\\{1,2\\}", ["\\{2,1\\}"]), ("x^2+1", ["1+x^2"]),
            ("\\begin{pmatrix}1&2\\end{pmatrix}", ["\\begin{pmatrix}1&2\\end{pmatrix}"]), ("\\sqrt{2}", ["2^{1/2}"])]


def serve_grader() -> None:
    """The grader child: `python -m services.env_worker.builtin.rewards`; JSON lines {given, truths, budget_s} in, verdicts out."""
    import logging

    logging.getLogger("math_verify").setLevel(logging.ERROR)  # "timeout disabled": the soft timer is ours

    def on_deadline(signum, frame):
        raise _Deadline()

    signal.signal(signal.SIGALRM, on_deadline)
    for given, truths in _WARM_UP:  # antlr builds its parse tables lazily: pay for that before the first task
        _answer({"given": given, "truths": truths, "budget_s": 30.0})
    print("ready", flush=True)
    for line in sys.stdin:
        print(json.dumps(_answer(json.loads(line))), flush=True)


class _Grader:
    """One math-verify child process. Killed when a check overruns its limit; the replacement starts at once,
    in the background, so the next check does not wait for sympy's import."""

    COMMAND = [sys.executable, "-m", "services.env_worker.builtin.rewards"]

    def __init__(self, command: list[str] | None = None):
        self.command = command or self.COMMAND
        self.proc: subprocess.Popen | None = None
        self.ready = False

    def check(self, given: str, truths: list[str], timeout_s: float) -> dict:
        self._ensure_ready()
        self.proc.stdin.write(json.dumps({"given": given, "truths": truths, "budget_s": timeout_s}) + "\n")
        self.proc.stdin.flush()
        line = self._readline(timeout_s)
        if not line:  # None: past the limit (stuck where its own timer cannot reach); "": the grader died
            self.stop()
            self._start()
            if line is None:
                return {"verdict": "timeout", "reason": "grader killed at the time limit"}
            return {"verdict": "wrong", "reason": "the grader process exited while grading this answer"}
        return json.loads(line)

    def _readline(self, timeout_s: float) -> str | None:
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout_s)
        return self.proc.stdout.readline() if ready else None

    def _start(self) -> None:
        self.proc = subprocess.Popen(self.command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1)
        self.ready = False

    def _ensure_ready(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            self._start()
        if not self.ready:
            if self._readline(GRADER_START_TIMEOUT_S) != "ready\n":
                self.stop()
                raise RuntimeError("math grader process did not start")
            self.ready = True

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
        self.proc = None


class GraderPool:
    """A few grader processes shared by the threads of one worker (the env worker runs envs in threads)."""

    def __init__(self, size: int = 2, command: list[str] | None = None):
        self.idle: queue.Queue[_Grader] = queue.Queue()
        for _ in range(size):
            grader = _Grader(command)
            grader._start()  # all of them import sympy at once, not one per first use
            self.idle.put(grader)

    def grade(self, given: str, truths: list[str], timeout_s: float = GRADING_TIMEOUT_S) -> dict:
        """{"verdict": "equal" | "wrong" | "rejected" | "timeout", "reason"?}; at most `timeout_s` of work."""
        grader = self.idle.get()
        try:
            return grader.check(given, truths, timeout_s)
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


# -- reward functions ----------------------------------------------------------------------------------------
def ground_truths(task: dict) -> list[str]:
    for key in ("ground_truth", "answer", "solution"):
        if task.get(key) is not None:
            value = task[key]
            return [str(v) for v in value] if isinstance(value, list) else [str(value)]
    raise ValueError("math task needs a 'ground_truth' (or 'answer') field with the reference answer")


def math_reward(task: dict, response: str, *, timeout_s: float = GRADING_TIMEOUT_S) -> RewardOutput:
    """1 if the last \\boxed{} after </think> equals a reference answer (see the module docstring), else 0."""
    started = time.monotonic()
    truths = [t if last_boxed(t) is None else last_boxed(t) for t in ground_truths(task)]
    text = final_answer_text(response)
    answer = last_boxed(text) if text is not None else None
    if answer is None:
        verdict = {"verdict": "no_answer", "reason": "no \\boxed{} answer after </think>"}
    else:
        try:
            verdict = {"answer": answer, **_grade(answer, truths, timeout_s)}
        except Exception as e:  # a grading bug must not turn the policy's episode into an error
            verdict = {"answer": answer, "verdict": "wrong",
                       "reason": f"grading failed: {type(e).__name__}: {str(e)[:200]}"}
    correct = verdict["verdict"] in ("string", "numeric", "symbolic")
    meta = {**verdict, "grading_s": round(time.monotonic() - started, 4)}
    if correct:
        meta["match"] = verdict["verdict"]
    return RewardOutput(float(correct), correct, meta)


def _grade(answer: str, truths: list[str], timeout_s: float) -> dict:
    given = normalize_answer(answer)
    keys = [normalize_answer(t) for t in truths]
    if given in keys:
        return {"verdict": "string"}
    numeric = [plain_numbers_equal(given, k) for k in keys]
    if all(n is not None for n in numeric):  # plain numbers on both sides: decided exactly, here
        return {"verdict": "numeric" if any(numeric) else "wrong"}
    rejection = screen_answer(answer, truths)
    if rejection:
        return {"verdict": "rejected", "reason": rejection}
    verdict = grader_pool().grade(exact_latex(answer), [exact_latex(t) for t in truths], timeout_s)
    return {**verdict, "verdict": "symbolic" if verdict["verdict"] == "equal" else verdict["verdict"]}


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
    used = sorted(n.lstrip("0") or "0" for n in re.findall(r"\d+", expr))  # no int(): no int-string limit
    if used != sorted(str(int(n)) for n in task["nums"]):
        return RewardOutput(0.0, False, {"expression": expr, "reason": "must use each number exactly once"})
    try:
        value = _eval_arith(expr)
    except (SyntaxError, ValueError, ZeroDivisionError, RecursionError, MemoryError, OverflowError) as e:
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
