"""Growth exponents of a benchmark's figures in one parameter (bench/long.py: bytes and CPU per episode in turns).

A figure that grows like x^k has slope k on log-log axes: the least-squares slope of log(y) on log(x) is that k
(1.0: linear, 2.0: quadratic). Here, not in bench/, so that the unit tests can check it (tests never import bench).
"""

from __future__ import annotations

import math


def growth_exponent(xs: list[float], ys: list[float]) -> float | None:
    """Least-squares slope of log(y) on log(x). None with fewer than two distinct positive x."""
    pts = [(math.log(x), math.log(y)) for x, y in zip(xs, ys, strict=True) if x > 0 and y > 0]
    if len({x for x, _ in pts}) < 2:
        return None
    mx, my = sum(x for x, _ in pts) / len(pts), sum(y for _, y in pts) / len(pts)
    return sum((x - mx) * (y - my) for x, y in pts) / sum((x - mx) ** 2 for x, _ in pts)


def exponents(cells: list[dict], key: str, x: str = "turns", series: str = "tokens_per_turn") -> dict:
    """The exponent of cells' `key` in `x`, per value of `series` (str keys, None for a series of one x), and
    the mean over the series that have one. `last_two_by_...`: the slope between a series' two largest x only,
    where fixed per-episode costs weigh least (a + b*x^2 fits below 2 over small x and tends to 2)."""
    groups: dict = {}
    for c in cells:
        groups.setdefault(c[series], []).append(c)
    by, last_two = {}, {}
    for s, cs in sorted(groups.items()):
        cs = sorted(cs, key=lambda c: c[x])
        by[str(s)] = growth_exponent([c[x] for c in cs], [c[key] for c in cs])
        last_two[str(s)] = growth_exponent([c[x] for c in cs[-2:]], [c[key] for c in cs[-2:]])
    fitted = [k for k in by.values() if k is not None]
    rounded = lambda d: {s: None if k is None else round(k, 3) for s, k in d.items()}  # noqa: E731
    return {"mean": round(sum(fitted) / len(fitted), 3) if fitted else None,
            f"by_{series}": rounded(by), f"last_two_by_{series}": rounded(last_two)}
