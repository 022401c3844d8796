"""shared.platform.service.wait_for never loses a cancellation, where Python 3.11's asyncio.wait_for returns the result
when the cancel lands as the awaited thing completes; services and shared/ use it, never asyncio's."""

from __future__ import annotations

import ast
import asyncio
import sys
from pathlib import Path

import pytest

from shared.platform.service import wait_for

REPO = Path(__file__).resolve().parents[3]


async def _lost_cancels(wait) -> int:
    """Cancel a task doing `wait(quick(), 1)` after 0..5 loop iterations: how often it went on after a cancel
    that reached it while still running."""
    lost = 0
    for spins in range(6):
        went_on = asyncio.Event()

        async def quick() -> int:
            await asyncio.sleep(0)  # one suspension: the cancel can land on either side of its completion
            return 1

        async def loop(went_on: asyncio.Event = went_on) -> None:
            await wait(quick(), 1)
            went_on.set()

        task = asyncio.create_task(loop())
        for _ in range(spins):
            await asyncio.sleep(0)
        requested = task.cancel()  # False: it had already finished, nothing to lose
        await asyncio.gather(task, return_exceptions=True)
        lost += requested and went_on.is_set()
    return lost


async def test_a_cancel_landing_as_the_awaited_completes_is_never_lost():
    assert await _lost_cancels(wait_for) == 0


@pytest.mark.skipif(sys.version_info >= (3, 12), reason="asyncio.wait_for keeps the cancel from Python 3.12 on")
async def test_the_race_is_real_for_asyncio_wait_for():
    assert await _lost_cancels(asyncio.wait_for) > 0  # the check above can fail


async def test_times_out_and_returns_results():
    assert await wait_for(asyncio.sleep(0, "x"), 1) == "x"
    with pytest.raises(TimeoutError):
        await wait_for(asyncio.sleep(5), 0.05)


def test_services_and_shared_never_call_asyncio_wait_for():
    found = []
    for folder in ("services", "shared", "infra"):
        for path in sorted((REPO / folder).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
                if (isinstance(node, ast.Attribute) and node.attr == "wait_for" and isinstance(node.value, ast.Name)
                        and node.value.id == "asyncio"):
                    found.append(f"{path.relative_to(REPO)}:{node.lineno}")
    assert found == [], f"{found} call asyncio.wait_for: use shared.platform.service.wait_for (keeps the cancel on 3.11)"
