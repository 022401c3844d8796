"""shared/platform/retry.py: retries only the named errors, waits between attempts, gives up within its budget."""

from __future__ import annotations

import asyncio
import time
from itertools import pairwise

import pytest

from shared.platform.retry import RetryPolicy


class Flaky(Exception):
    pass


def failing(times: int, error: BaseException):
    calls = []

    def fn():
        calls.append(time.monotonic())
        if len(calls) <= times:
            raise error
        return "ok"

    return fn, calls


def test_retries_named_error_until_success():
    fn, calls = failing(3, Flaky())
    assert RetryPolicy((Flaky,), attempts=5, first_wait_s=0.01).call(fn) == "ok"
    assert len(calls) == 4


def test_other_errors_propagate_at_once():
    fn, calls = failing(3, KeyError("bad input"))
    with pytest.raises(KeyError):
        RetryPolicy((Flaky,), attempts=5, first_wait_s=0.01).call(fn)
    assert len(calls) == 1


def test_gives_up_after_attempts_with_the_last_error():
    fn, calls = failing(100, Flaky("still down"))
    with pytest.raises(Flaky, match="still down"):
        RetryPolicy((Flaky,), attempts=3, first_wait_s=0.01).call(fn)
    assert len(calls) == 3


def test_gives_up_within_the_total_budget():
    fn, calls = failing(1000, Flaky())
    start = time.monotonic()
    with pytest.raises(Flaky):
        RetryPolicy((Flaky,), budget_s=0.5, first_wait_s=0.05, max_wait_s=0.1).call(fn)
    elapsed = time.monotonic() - start
    assert elapsed < 0.5 + 0.2  # never starts a wait that would end past the budget (+ slack for a busy machine)
    assert 4 <= len(calls) <= 6  # waits of 0.05, 0.1, 0.1, ... fit 4-5 attempts in 0.5 s
    waits = [b - a for a, b in pairwise(calls)]
    assert waits[0] >= 0.05 and min(waits[1:]) >= 0.1  # exponential from first_wait_s, capped at max_wait_s


async def test_async_attempt_timeout_counts_as_transient():
    calls = []

    async def slow_then_fast():
        calls.append(1)
        if len(calls) == 1:
            await asyncio.sleep(10)  # hangs: cut off by the per-attempt timeout
        return "ok"

    policy = RetryPolicy((Flaky,), attempts=2, attempt_timeout_s=0.1, first_wait_s=0.01)
    start = time.monotonic()
    assert await policy.call_async(slow_then_fast) == "ok"
    assert len(calls) == 2 and time.monotonic() - start < 1.0


async def test_async_gives_up_and_does_not_retry_unnamed_errors():
    async def boom():
        raise ValueError("not transient")

    with pytest.raises(ValueError):
        await RetryPolicy((Flaky,)).call_async(boom)  # no limits at all, yet tried once

    fn, calls = failing(100, Flaky())

    async def flaky():
        return fn()

    with pytest.raises(Flaky):
        await RetryPolicy((Flaky,), attempts=4, first_wait_s=0.01).call_async(flaky)
    assert len(calls) == 4


def test_a_policy_without_transient_errors_is_refused():
    with pytest.raises(ValueError, match="transient"):
        RetryPolicy(())
