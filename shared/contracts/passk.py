"""Unbiased pass@k (Chen et al. 2021): with n samples of a task of which c are correct,

    pass@k = 1 - C(n - c, k) / C(n, k)

the probability that at least one of k samples drawn without replacement is correct. Averaged over tasks,
overall and per data source. Exact integer binomials (math.comb): no float overflow for large n."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable
from fractions import Fraction
from math import comb


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased estimate for one task. Requires 0 <= c <= n and 1 <= k <= n."""
    if not (0 <= c <= n and 1 <= k <= n):
        raise ValueError(f"pass_at_k needs 0 <= c <= n and 1 <= k <= n, got n={n} c={c} k={k}")
    return float(1 - Fraction(comb(n - c, k), comb(n, k)))


def pass_at_k_table(results: Iterable[tuple[str, str, bool]]) -> dict:
    """`results`: (task_id, data_source, is_correct) per sample. Returns
    {"num_tasks", "n", "pass@k": {"1": .., ...}, "by_source": {src: {"num_tasks", "pass@k"}}}.

    k runs 1..n where n is the smallest sample count over tasks (every task must have >= k samples)."""
    per_task: dict[str, list] = {}
    for task_id, source, correct in results:
        entry = per_task.setdefault(task_id, [source, 0, 0])
        entry[1] += 1
        entry[2] += int(bool(correct))
    if not per_task:
        return {"num_tasks": 0, "n": 0, "pass@k": {}, "by_source": {}}
    n_min = min(n for _, n, _ in per_task.values())
    groups: dict[str, list[tuple[int, int]]] = defaultdict(list)
    for source, n, c in per_task.values():
        groups[source].append((n, c))
    every = [nc for g in groups.values() for nc in g]
    return {
        "num_tasks": len(per_task), "n": n_min, "pass@k": _mean_table(every, n_min),
        "by_source": {s: {"num_tasks": len(g), "pass@k": _mean_table(g, n_min)} for s, g in sorted(groups.items())},
    }


def _mean_table(tasks: list[tuple[int, int]], n_max: int) -> dict[str, float]:
    return {str(k): sum(pass_at_k(n, c, k) for n, c in tasks) / len(tasks) for k in range(1, n_max + 1)}
