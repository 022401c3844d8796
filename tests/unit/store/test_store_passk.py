"""pass@k against brute force: average over every k-subset of the n samples of "any correct"."""

from itertools import combinations

import pytest

from shared.contracts.passk import pass_at_k, pass_at_k_table


def brute_force(n: int, c: int, k: int) -> float:
    samples = [True] * c + [False] * (n - c)
    subsets = list(combinations(samples, k))
    return sum(any(s) for s in subsets) / len(subsets)


@pytest.mark.parametrize("n", [1, 2, 5, 8])
def test_pass_at_k_matches_brute_force(n):
    for c in range(n + 1):
        for k in range(1, n + 1):
            assert pass_at_k(n, c, k) == pytest.approx(brute_force(n, c, k), abs=1e-12)


def test_pass_at_k_large_n_is_exact():
    assert pass_at_k(1000, 1, 1) == pytest.approx(0.001)
    assert pass_at_k(1000, 0, 500) == 0.0
    assert pass_at_k(1000, 600, 401) == 1.0  # fewer than k incorrect samples: some draw must be correct


def test_pass_at_k_rejects_bad_counts():
    with pytest.raises(ValueError, match="c <= n"):
        pass_at_k(3, 4, 1)
    with pytest.raises(ValueError, match="k <= n"):
        pass_at_k(3, 1, 4)


def test_table_overall_and_per_source():
    results = [("a", "math", True), ("a", "math", False), ("a", "math", False),
               ("b", "math", False), ("b", "math", False), ("b", "math", False),
               ("c", "count", True), ("c", "count", True), ("c", "count", False)]
    table = pass_at_k_table(results)
    assert table["n"] == 3 and table["num_tasks"] == 3
    for k in (1, 2, 3):
        per = [brute_force(3, 1, k), brute_force(3, 0, k), brute_force(3, 2, k)]
        assert table["pass@k"][str(k)] == pytest.approx(sum(per) / 3)
        assert table["by_source"]["math"]["pass@k"][str(k)] == pytest.approx((per[0] + per[1]) / 2)
        assert table["by_source"]["count"]["pass@k"][str(k)] == pytest.approx(per[2])


def test_table_empty():
    assert pass_at_k_table([])["pass@k"] == {}
