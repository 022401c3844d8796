"""Generators for small built-in datasets (nothing can be downloaded here): `generate(name, n, seed)`.

    rows = generate("arithmetic", 100, seed=0)   # [{"id", "question", "ground_truth", "data_source"}, ...]

Every row has an "id" (the task id) and a "data_source"; rows are deterministic in (name, n, seed).
"""

from __future__ import annotations

import random
from collections.abc import Callable

BOXED_HINT = "Put your final answer within \\boxed{}."


def arithmetic(n: int, seed: int) -> list[dict]:
    """Two-operand integer arithmetic with boxed answers."""
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        a, b = rng.randint(2, 99), rng.randint(2, 99)
        op = rng.choice("+-*")
        answer = {"+": a + b, "-": a - b, "*": a * b}[op]
        rows.append({"id": f"arith-{seed}-{i}", "question": f"What is {a} {op} {b}?",
                     "ground_truth": str(answer), "data_source": "arithmetic"})
    return rows


def countdown(n: int, seed: int, num_count: int = 3) -> list[dict]:
    """Reach `target` with + - * over `nums`, each used once. Targets come from a random solvable expression."""
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        nums = [rng.randint(1, 20) for _ in range(num_count)]
        expr = str(nums[0])
        for x in nums[1:]:
            expr = f"({expr} {rng.choice('+-*')} {x})"
        target = eval(expr)  # our own expression of integers and + - *
        question = (f"Using the numbers {nums}, create an equation that equals {target}. Use + - * / and each "
                    f"number exactly once. Put the expression within \\boxed{{}}, e.g. \\boxed{{(1 + 2) * 3}}.")
        rows.append({"id": f"countdown-{seed}-{i}", "nums": nums, "target": target, "question": question,
                     "data_source": "countdown"})
    return rows


def frozenlake(n: int, seed: int, size: int = 4, p: float = 0.8) -> list[dict]:
    """Random solvable FrozenLake maps (gymnasium's generator): S start, G goal, H hole, F frozen."""
    from gymnasium.envs.toy_text.frozen_lake import generate_random_map

    rows = []
    for i in range(n):
        map_seed = seed * 100_003 + i
        desc = generate_random_map(size=size, p=p, seed=map_seed)
        rows.append({"id": f"frozenlake-{seed}-{i}", "map": desc, "size": size, "seed": map_seed,
                     "max_turns": 2 * size * size, "data_source": "frozenlake"})
    return rows


def recall(n: int, seed: int) -> list[dict]:
    """A number word -> its digit ("seven" -> "7"): the task a tiny model learns in minutes (shared.tasks.recall)."""
    from shared.tasks.recall import dataset_rows

    return [{"id": f"recall-{seed}-{i}", "question": r["question"], "answer": r["answer"], "data_source": "recall"}
            for i, r in enumerate(dataset_rows(n, seed))]


def digits(n: int, seed: int, turns: int = 3, lengths: list[int] | None = None) -> list[dict]:
    """Tasks of the multi-turn digits env (services/env_worker/builtin/envs.py: DigitsEnv): the first number word and the
    secret offset of each later turn. Each run of ten rows starts once from every word. `lengths`: each row's
    number of turns drawn from these instead of `turns` (a curriculum: short tasks teach what long ones need)."""
    if turns < 1 or any(k < 1 for k in lengths or ()):
        raise ValueError(f"turns and lengths must be >= 1, got turns={turns}, lengths={lengths}")
    from shared.tasks.recall import WORDS as NUMBER_WORDS

    rng = random.Random(seed)
    rows = []
    for block in range(0, n, len(NUMBER_WORDS)):
        for word in rng.sample(NUMBER_WORDS, len(NUMBER_WORDS))[: n - block]:
            length = rng.choice(lengths) if lengths else turns
            rows.append({"id": f"digits-{seed}-{len(rows)}", "first": word,
                         "offsets": [rng.randrange(10) for _ in range(length - 1)], "data_source": "digits"})
    return rows


GENERATORS: dict[str, Callable[..., list[dict]]] = {
    "arithmetic": arithmetic, "countdown": countdown, "frozenlake": frozenlake, "recall": recall,
    "digits": digits,
}


def generate(name: str, n: int, seed: int = 0, **kwargs) -> list[dict]:
    if name not in GENERATORS:
        raise ValueError(f"unknown built-in dataset {name!r}; choose one of {', '.join(GENERATORS)}")
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    return GENERATORS[name](n, seed, **kwargs)
