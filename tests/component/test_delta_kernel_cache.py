"""numba's disk cache of the delta kernels (shared/weights/kernels.py) shared by many processes: each makes its
specializations holding the machine-wide lock file, and what one saved, others load and compute right with."""

from __future__ import annotations

import fcntl
import os
import subprocess
import sys
import time
from pathlib import Path

from shared.weights import kernels as delta_kernels

CHECK = """
import numpy as np
from shared.weights.kernels import GAP_DTYPES, ELEMENT_DTYPES, changes, patch, unpatch
rng = np.random.default_rng(1)
for dtype in ELEMENT_DTYPES:
    old = rng.integers(-100, 100, 1003).astype(dtype)
    new = old.copy()
    new[rng.random(old.size) < 0.1] += 1
    gaps, vals = changes(old, new)
    idx = np.flatnonzero(old != new)
    assert np.array_equal(np.cumsum(gaps.astype(np.int64)), idx) and np.array_equal(vals, new[idx]), dtype
    for gap_dtype in GAP_DTYPES:
        live = old.copy()
        undo = patch(live, gaps.astype(gap_dtype), vals)
        assert np.array_equal(live, new), (dtype, gap_dtype)
        unpatch(live, gaps.astype(gap_dtype), undo)
        assert np.array_equal(live, old), (dtype, gap_dtype)
print("ok", flush=True)
"""


def _python(code: str, cache: Path) -> subprocess.Popen:
    env = dict(os.environ, NUMBA_CACHE_DIR=str(cache))  # numba's first choice of cache folder
    return subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)


def test_processes_that_share_a_cache_save_in_turn_and_load_correct_kernels(tmp_path):
    cache = tmp_path / "numba"
    warmers = [_python("from shared.weights.kernels import warm_up; warm_up()", cache) for _ in range(3)]
    for p in warmers:
        _, err = p.communicate(timeout=300)
        assert p.returncode == 0, err[-2000:]
    saved = sorted(f.name for f in cache.rglob("*.nbi"))
    assert len(saved) == 4, saved  # an index per kernel: count, emit, patch, unpatch
    checker = _python(CHECK, cache)  # every specialization comes from the cache now
    out, err = checker.communicate(timeout=300)
    assert checker.returncode == 0 and out.strip() == "ok", err[-2000:]
    assert sorted(f.name for f in cache.rglob("*.nbi")) == saved


def test_a_process_waits_for_the_lock_before_it_compiles_or_saves(tmp_path):
    cache = tmp_path / "numba"
    fd = os.open(delta_kernels._LOCK_FILE, os.O_RDONLY | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # another process is making the kernels
        waiting = _python("import shared.weights.kernels\nprint('imported', flush=True)\n" + CHECK, cache)
        assert waiting.stdout.readline().strip() == "imported"
        time.sleep(2.0)
        assert waiting.poll() is None and not list(cache.rglob("*.nb*"))  # blocked: nothing compiled or saved
    finally:
        os.close(fd)
    out, err = waiting.communicate(timeout=300)
    assert waiting.returncode == 0 and out.strip() == "ok", err[-2000:]
    assert list(cache.rglob("*.nbi"))


def test_the_kernels_work_where_numba_has_nowhere_to_cache_them():
    """A read-only image with no writable home: numba refuses `cache=True` there, which must not break imports."""
    code = ("import numba.core.caching as c\n"
            "(getattr(c, 'CacheImpl', None) or c._CacheImpl)._locator_classes = []  # no place to cache\n"
            "import numpy as np\n"
            "from shared.weights.kernels import changes, patch\n"
            "old = np.zeros(9, np.int16); new = old.copy(); new[[2, 8]] = 5\n"
            "gaps, vals = changes(old, new); patch(old, gaps, vals); assert (old == new).all(); print('ok')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]
