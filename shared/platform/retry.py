"""One retry policy for every I/O boundary that rides out transient failures (tenacity underneath).

    SEND = RetryPolicy(transient=REDIS_DOWN, attempts=8, first_wait_s=0.1, max_wait_s=2.0)
    entry_id = await SEND.call_async(lambda: bus.publish(stream, msg))

Only the errors a policy names are retried, with exponential waits, until `budget_s` or `attempts` runs out;
then the last transient error is re-raised. Without either it retries forever: only for work that must not be
dropped and whose caller can wait.

More: docs/reliability.md#retries
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TypeVar

from tenacity import (
    AsyncRetrying,
    RetryCallState,
    Retrying,
    retry_if_exception_type,
    stop_after_attempt,
    stop_before_delay,
    stop_never,
    wait_exponential,
)

from shared.platform.logs import get_logger

log = get_logger(__name__)
T = TypeVar("T")


@dataclass(frozen=True)
class RetryPolicy:
    """Which errors to retry, how long to wait between attempts, and when to give up (module docstring)."""

    transient: tuple[type[BaseException], ...]
    attempts: int | None = None  # at most this many attempts in all; None: no count limit
    budget_s: float | None = None  # give up rather than start a wait that ends past this; None: no time limit
    attempt_timeout_s: float | None = None  # per attempt (call_async enforces it; sync callers pass it on)
    first_wait_s: float = 0.5
    max_wait_s: float = 10.0
    what: str = "call"  # named in the warning logged before each wait

    def __post_init__(self) -> None:
        if not self.transient:
            raise ValueError("RetryPolicy needs at least one transient error type to retry")
        if self.attempts is not None and self.attempts < 1:
            raise ValueError(f"attempts must be >= 1, got {self.attempts}")

    def _kwargs(self) -> dict:
        transient = self.transient
        if self.attempt_timeout_s is not None and not issubclass(TimeoutError, transient):
            transient = (*transient, TimeoutError)
        stop = stop_never
        if self.attempts is not None:
            stop = stop_after_attempt(self.attempts)
        if self.budget_s is not None:
            stop = stop_before_delay(self.budget_s) if stop is stop_never else stop | stop_before_delay(self.budget_s)
        return dict(retry=retry_if_exception_type(transient), stop=stop, reraise=True,
                    wait=wait_exponential(multiplier=self.first_wait_s, min=self.first_wait_s, max=self.max_wait_s),
                    before_sleep=self._log)

    def _log(self, state: RetryCallState) -> None:
        error = state.outcome.exception() if state.outcome is not None else None
        wait = state.next_action.sleep if state.next_action is not None else 0.0
        log.warning("%s failed (attempt %d), retrying in %.1fs: %r", self.what, state.attempt_number, wait, error)

    async def call_async(self, fn: Callable[[], Awaitable[T]]) -> T:
        """Await `fn()` until it succeeds, a non-transient error propagates, or the policy gives up."""
        async for attempt in AsyncRetrying(**self._kwargs()):
            with attempt:
                if self.attempt_timeout_s is None:
                    return await fn()
                async with asyncio.timeout(self.attempt_timeout_s):
                    return await fn()
        raise AssertionError("unreachable: tenacity re-raises the last error")

    def call(self, fn: Callable[[], T]) -> T:
        """Synchronous `call_async`; `attempt_timeout_s` is for the caller's client to apply."""
        return Retrying(**self._kwargs())(fn)
