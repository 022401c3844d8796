"""Fair sharing of rollout capacity between running runs: weighted max-min fairness ("water-filling").

All runs' tasks go through one FIFO stream, so a run with many slow tasks in flight would queue every other
run behind it. Under a capacity (the rollout workers' total concurrency) each run may have at most its share in
flight: capacity split by priority, where a run that needs less than its share (its own max_in_flight) keeps
only what it needs and the rest is split among the others. Every run gets at least one slot, so every run
progresses."""

from __future__ import annotations


def fair_shares(capacity: int, runs: dict[str, tuple[float, int]]) -> dict[str, int]:
    """`runs`: run id -> (priority, max_in_flight). Returns run id -> in-flight limit."""
    shares: dict[str, int] = {}
    left, active = float(capacity), dict(runs)
    while active:  # runs whose own cap is below their weighted share take just their cap
        total = sum(w for w, _ in active.values())
        capped = {r: cap for r, (w, cap) in active.items() if cap <= left * w / total}
        if not capped:
            break
        for r, cap in capped.items():
            shares[r] = cap
            left -= cap
            del active[r]
    total = sum(w for w, _ in active.values())
    for r, (w, _) in active.items():
        shares[r] = max(1, int(left * w / total))
    return shares
