"""Math grading cases: each graded by services.env_worker.builtin.rewards.math_reward, with its verdict and the time it took.

    python -m tests.support.grading            # writes bench/results/grading.json

The same table is asserted case by case in tests/component/test_math_grading.py. A case is
(name, response, reference, correct, verdict): `verdict` is the one math_reward must report, or None where
only correctness is asserted. Adversarial cases (power towers, huge factorials, deep nesting, numbers past
Python's int-string limit) must score 0 with verdict "rejected" or "timeout": the grader's own time limit
(GRADING_TIMEOUT_S), not a wall-clock check, is what bounds them.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from pathlib import Path


def _nested_fractions(depth: int) -> str:
    s = "1"
    for _ in range(depth):
        s = f"\\frac{{1}}{{1+{s}}}"
    return s


B = "\\boxed"
CASES: list[tuple[str, str, str, bool, str | None]] = [
    # -- equivalent forms ---------------------------------------------------------------------------------
    ("integer", f"{B}{{42}}", "42", True, "string"),
    ("fraction vs decimal", f"{B}{{\\frac{{3}}{{4}}}}", "0.75", True, "symbolic"),
    ("dfrac vs frac", f"{B}{{\\dfrac{{3}}{{4}}}}", "\\frac{3}{4}", True, "string"),
    ("slash fraction", f"{B}{{3/4}}", "\\frac{3}{4}", True, "symbolic"),
    ("unreduced fraction", f"{B}{{\\frac{{6}}{{8}}}}", "\\frac{3}{4}", True, "symbolic"),
    ("wrong fraction", f"{B}{{\\frac{{2}}{{3}}}}", "\\frac{3}{4}", False, "wrong"),
    ("mixed number vs fraction", f"{B}{{2\\frac{{1}}{{2}}}}", "\\frac{5}{2}", True, "symbolic"),
    ("mixed number vs decimal", f"{B}{{2\\frac{{1}}{{2}}}}", "2.5", True, "symbolic"),
    ("interval spacing", f"{B}{{(1, 2]}}", "(1,2]", True, "string"),
    ("interval left-right", f"{B}{{\\left(1,2\\right]}}", "(1,2]", True, "string"),
    ("interval wrong ends", f"{B}{{[1,2)}}", "(1,2]", False, "wrong"),
    ("interval union order", f"{B}{{(1,\\infty)\\cup(-\\infty,0)}}", "(-\\infty,0)\\cup(1,\\infty)", True, "symbolic"),
    ("set order", f"{B}{{\\{{3,2,1\\}}}}", "\\{1,2,3\\}", True, "symbolic"),
    ("set wrong", f"{B}{{\\{{1,3\\}}}}", "\\{1,2\\}", False, "wrong"),
    ("matrix", f"{B}{{\\begin{{pmatrix}}1&2\\\\3&4\\end{{pmatrix}}}}",
     "\\begin{pmatrix}1 & 2\\\\ 3 & 4\\end{pmatrix}", True, None),
    ("matrix brackets", f"{B}{{\\begin{{bmatrix}}1&2\\\\3&4\\end{{bmatrix}}}}",
     "\\begin{pmatrix}1&2\\\\3&4\\end{pmatrix}", True, "symbolic"),
    ("matrix decimal entries", f"{B}{{\\begin{{pmatrix}}0.5&1\\end{{pmatrix}}}}",
     "\\begin{pmatrix}\\frac{1}{2}&1\\end{pmatrix}", True, "symbolic"),
    ("matrix wrong", f"{B}{{\\begin{{pmatrix}}1&2\\\\3&5\\end{{pmatrix}}}}",
     "\\begin{pmatrix}1&2\\\\3&4\\end{pmatrix}", False, "wrong"),
    ("units text", f"{B}{{5\\text{{ cm}}}}", "5", True, None),
    ("units meters", f"{B}{{12\\text{{ meters}}}}", "12", True, None),
    ("thousands separators", f"{B}{{1,000,000}}", "1000000", True, "string"),
    ("thousands latex comma", f"{B}{{1{{,}}234}}", "1234", True, "string"),
    ("thousands with decimals", f"{B}{{1,234.5}}", "1234.50", True, "numeric"),
    ("tuple is not thousands", f"{B}{{1,2}}", "12", False, "wrong"),
    ("unicode minus", f"{B}{{\u22127}}", "-7", True, "string"),
    ("unicode minus fraction", f"{B}{{\u2212\\frac{{1}}{{2}}}}", "-0.5", True, "symbolic"),
    ("degrees circ", f"{B}{{45^\\circ}}", "45", True, "string"),
    ("degrees unicode", f"{B}{{45\u00b0}}", "45", True, "string"),
    ("degrees are not radians", f"{B}{{\\frac{{\\pi}}{{4}}}}", "45^\\circ", False, "wrong"),
    ("scientific e", f"{B}{{1.5e3}}", "1500", True, "numeric"),
    ("scientific times", f"{B}{{1.5\\times10^{{3}}}}", "1500", True, "symbolic"),
    ("scientific cdot negative", f"{B}{{2.5 \\cdot 10^{{-3}}}}", "0.0025", True, "symbolic"),
    ("text number", f"{B}{{\\text{{7}}}}", "7", True, "string"),
    ("text choice", f"{B}{{\\text{{(B)}}}}", "B", True, None),
    ("last boxed after think", f"<think>maybe {B}{{3}}</think> so {B}{{4}}", "4", True, "string"),
    ("boxed inside think ignored", f"<think>maybe {B}{{4}}</think> so {B}{{3}}", "4", False, "wrong"),
    ("unterminated think", f"<think>maybe {B}{{4}}", "4", False, "no_answer"),
    ("no boxed", "the answer is 4", "4", False, "no_answer"),
    ("last of two boxed", f"{B}{{3}}, no wait: {B}{{4}}", "4", True, "string"),
    ("sqrt forms", f"{B}{{\\frac{{1}}{{\\sqrt{{2}}}}}}", "\\frac{\\sqrt{2}}{2}", True, "symbolic"),
    ("pi product", f"{B}{{\\pi \\cdot 2}}", "2\\pi", True, "symbolic"),
    ("polynomial", f"{B}{{x^2+2x+1}}", "(x+1)^2", True, "symbolic"),
    ("assignment", f"{B}{{x = 5}}", "5", True, "string"),
    ("big power exact", f"{B}{{2^{{100}}}}", "1267650600228229401496703205376", True, "symbolic"),
    ("factorial exact", f"{B}{{10!}}", "3628800", True, "symbolic"),
    ("boxed reference", f"{B}{{7}}", "\\boxed{7}", True, "string"),
    # -- percent: a unit on either side ------------------------------------------------------------------
    ("percent answer", f"{B}{{50\\%}}", "50", True, "string"),
    ("percent reference", f"{B}{{50}}", "50\\%", True, "string"),
    ("percent bare sign", f"{B}{{50%}}", "50", True, "string"),
    ("percent decimal", f"{B}{{12.5\\%}}", "12.50", True, "numeric"),
    ("percent text", f"{B}{{50\\text{{\\%}}}}", "50", True, None),
    ("percent is not a fraction", f"{B}{{50\\%}}", "0.5", False, "wrong"),
    ("fraction is not a percent", f"{B}{{0.5}}", "50\\%", False, "wrong"),
    ("percent wrong", f"{B}{{40\\%}}", "50\\%", False, "wrong"),
    # -- decimals are exact numbers, approximations are wrong -------------------------------------------
    ("exact decimal half", f"{B}{{0.5}}", "\\frac{1}{2}", True, "symbolic"),
    ("exact decimal eighth", f"{B}{{0.125}}", "\\frac{1}{8}", True, "symbolic"),
    ("trailing zeros", f"{B}{{2.50}}", "2.5", True, "numeric"),
    ("repeated digits 3", f"{B}{{0.333}}", "\\frac{1}{3}", False, "wrong"),
    ("repeated digits 6", f"{B}{{0.333333}}", "\\frac{1}{3}", False, "wrong"),
    ("repeated digits 16", f"{B}{{0.3333333333333333}}", "\\frac{1}{3}", False, "wrong"),
    ("rounded two thirds", f"{B}{{0.666667}}", "\\frac{2}{3}", False, "wrong"),
    ("pi truncated", f"{B}{{3.14159}}", "\\pi", False, "wrong"),
    ("pi to 6 places", f"{B}{{3.141593}}", "\\pi", False, "wrong"),
    ("pi to 35 places", f"{B}{{3.14159265358979323846264338327950288}}", "\\pi", False, "wrong"),
    ("sqrt2 truncated", f"{B}{{1.41421356}}", "\\sqrt{2}", False, "wrong"),
    ("sqrt2 to 19 places", f"{B}{{1.4142135623730950488}}", "\\sqrt{2}", False, "wrong"),
    ("half sqrt2 truncated", f"{B}{{0.70710678}}", "\\frac{\\sqrt{2}}{2}", False, "wrong"),
    ("2pi truncated", f"{B}{{6.283185}}", "2\\pi", False, "wrong"),
    ("sqrt of near-2", f"{B}{{\\sqrt{{2.00000000000000000001}}}}", "\\sqrt{2}", False, "wrong"),
    ("symbol for decimal reference", f"{B}{{\\pi}}", "3.14", False, "wrong"),
    # -- numbers past Python's int-string limit ----------------------------------------------------------
    ("5000 digits vs small", f"{B}{{{'1' * 5000}}}", "1", False, "wrong"),
    ("5000 digits vs fraction", f"{B}{{{'9' * 5000}}}", "\\frac{1}{3}", False, "rejected"),
    ("5000-digit numerator", f"{B}{{\\frac{{{'1' * 5000}}}{{3}}}}", "\\frac{1}{3}", False, "rejected"),
    ("5000 digits equal", f"{B}{{{'7' * 5000}}}", "7" * 5000, True, "string"),
    ("5000 digits off by one", f"{B}{{{'7' * 4999}8}}", "7" * 5000, False, "wrong"),
    # -- expensive expressions: rejected before symbolic work --------------------------------------------
    ("power tower 9", f"{B}{{9^{{9^{{9^9}}}}}}", "1", False, "rejected"),
    ("power tower 2", f"{B}{{2^{{2^{{2^{{2^{{2}}}}}}}}}}", "1", False, "rejected"),
    ("googolplex-ish", f"{B}{{10^{{10^{{6}}}}}}", "1", False, "rejected"),
    ("huge power", f"{B}{{2^{{100000000}}}}", "1", False, "rejected"),
    ("huge factorial", f"{B}{{100000!}}", "1", False, "rejected"),
    ("factorial of factorial", f"{B}{{(10!)!}}", "1", False, "rejected"),
    ("tower with units", f"{B}{{9^{{9^{{9^9}}}}\\text{{ cm}}}}", "1", False, "rejected"),
    ("symbolic huge power", f"{B}{{(x+1)^{{100000}}}}", "x", False, "rejected"),
    ("nested fractions 15", f"{B}{{{_nested_fractions(15)}}}", "1", False, "rejected"),
    ("nested fractions 40", f"{B}{{{_nested_fractions(40)}}}", "1", False, "rejected"),
    ("nested parentheses", f"{B}{{{'(' * 40}1{')' * 40}}}", "1", False, "rejected"),
    ("nested roots", B + "{" + "\\sqrt{" * 30 + "2" + "}" * 30 + "}", "1", False, "rejected"),
    ("long sum", f"{B}{{{'1+' * 300}1}}", "301", False, "rejected"),
    ("nested parentheses 7", f"{B}{{{'(' * 7}1{')' * 7}}}", "1", False, "rejected"),
    ("depth 4 still graded", f"{B}{{\\frac{{1}}{{2}}\\left(1+\\sqrt{{\\frac{{3}}{{2}}}}\\right)}}",
     "\\frac{1}{2}+\\frac{\\sqrt{6}}{4}", True, "symbolic"),
    ("shallow nested fractions still graded", f"{B}{{{_nested_fractions(3)}}}", "\\frac{3}{5}", True, "symbolic"),
]


def run(cases=CASES) -> list[dict]:
    from services.env_worker.builtin.rewards import math_reward

    results = []
    for name, response, truth, correct, verdict in cases:
        started = time.perf_counter()
        out = math_reward({"ground_truth": truth}, response)
        elapsed = time.perf_counter() - started
        results.append({
            "case": name, "expected_correct": correct, "correct": out.is_correct,
            "expected_verdict": verdict, "verdict": out.metadata.get("verdict"),
            "ok": out.is_correct == correct and verdict in (None, out.metadata.get("verdict")),
            "time_s": round(elapsed, 4), "reason": out.metadata.get("reason"),
        })
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="bench/results/grading.json")
    args = parser.parse_args()
    from services.env_worker.builtin.rewards import GRADING_TIMEOUT_S, math_reward

    math_reward({"ground_truth": "1"}, "\\boxed{\\frac{2}{2}}")  # start the grader pool: not a case's time
    results = run()
    for r in results:
        print(f"{'ok  ' if r['ok'] else 'FAIL'} {r['time_s']:7.3f}s  {r['verdict']:<9} {r['case']}")
    times = sorted(r["time_s"] for r in results)
    summary = {
        "cases": len(results), "passed": sum(r["ok"] for r in results), "grading_timeout_s": GRADING_TIMEOUT_S,
        "max_time_s": times[-1], "median_time_s": times[len(times) // 2], "machine": platform.machine(),
        "cpus": os.cpu_count(), "load_avg_1m": round(os.getloadavg()[0], 2),
        "results": results,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(summary, indent=1) + "\n")
    print(f"{summary['passed']}/{summary['cases']} as expected, max {summary['max_time_s']} s -> {args.out}")


if __name__ == "__main__":
    main()
