"""A host whose clock is off, for tests: a Python process with this folder on its PYTHONPATH imports this module at
start (site's `sitecustomize` hook), and when FAKE_CLOCK_SKEW_S is set its wall clock (time.time, time.time_ns)
reads that many seconds ahead (negative: behind). Monotonic clocks are left alone, as on a real host."""

import os
import time

_skew_s = float(os.environ.get("FAKE_CLOCK_SKEW_S") or 0)
if _skew_s:
    _time, _time_ns = time.time, time.time_ns
    time.time = lambda: _time() + _skew_s
    time.time_ns = lambda: _time_ns() + int(_skew_s * 1e9)
