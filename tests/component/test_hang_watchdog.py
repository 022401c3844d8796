"""tests/conftest.py's watchdog: a test still running past its timeout plus the grace (a teardown pytest-timeout
cannot interrupt) ends the session with the test's name and the stacks, instead of holding CI to its limit."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_a_hung_teardown_ends_the_session_with_the_stacks():
    case = REPO / "tests" / "unit" / f"test_hang_case_{os.getpid()}.py"
    case.write_text(textwrap.dedent("""
        import asyncio, pytest

        @pytest.fixture
        async def stubborn():
            async def ignores_cancel():
                while True:
                    try:
                        await asyncio.sleep(1)
                    except asyncio.CancelledError:
                        pass
            asyncio.create_task(ignores_cancel())
            yield

        @pytest.mark.timeout(1)
        async def test_hangs(stubborn):
            await asyncio.sleep(60)
    """))
    try:
        proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(case)], cwd=REPO,
                              env={**os.environ, "FW_HANG_GRACE_S": "2"}, capture_output=True, text=True,
                              timeout=120)
    finally:
        case.unlink()
    assert proc.returncode == 1
    assert f"{case.name}::test_hangs still running 3s in, past its timeout" in proc.stderr
    assert "ignores_cancel" in proc.stderr or "_cancel_all_tasks" in proc.stderr  # where it hung
