"""Pure parts of the local stack: the service table, restart backoff, the socket path.

    pytest -q tests/unit/harness/test_harness_stack.py
"""

from __future__ import annotations

import importlib.util
import tomllib
from pathlib import Path

from infra.local.servers import _redis_socket_path
from infra.local.stack import SERVICES, Backoff, ConsoleFilter

REPO = Path(__file__).resolve().parents[3]


def test_service_table_matches_the_console_scripts():
    scripts = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]
    for name, spec in SERVICES.items():
        assert spec.args[0] == "-m"
        assert scripts[f"flywheel-{name}"] == f"{spec.args[1]}:main", f"{name}: stack and console script differ"
    assert scripts["flywheel-stack"] == "infra.local.stack:main"
    assert importlib.util.find_spec("infra.local.stack") is not None


def test_http_services_are_probed_on_their_own_port():
    assert SERVICES["api"].port_env == "API_PORT"
    assert SERVICES["weight-server"].port_env == "WEIGHT_SERVER_PORT"
    assert {s.port_env for n, s in SERVICES.items() if n not in ("api", "weight-server")} == {"HEALTH_PORT"}


def test_backoff_doubles_to_its_cap_and_resets_after_a_long_uptime():
    b = Backoff(base_s=1.0, cap_s=5.0, reset_after_s=60.0)
    assert [b.next_delay(uptime_s=2.0) for _ in range(5)] == [1.0, 2.0, 4.0, 5.0, 5.0]
    assert b.next_delay(uptime_s=61.0) == 1.0  # up a minute: a new crash is not part of the old loop
    assert b.next_delay(uptime_s=0.5) == 2.0


def test_redis_socket_path_is_short_and_stable_for_deep_folders(tmp_path):
    assert _redis_socket_path(tmp_path) == tmp_path / "redis.sock" or len(str(tmp_path)) >= 90
    deep = Path("/tmp") / ("d" * 120)
    path = _redis_socket_path(deep)
    assert len(str(path)) < 100 and path == _redis_socket_path(deep) != _redis_socket_path(deep / "x")


def test_the_console_shows_warnings_errors_and_their_tracebacks_not_info_or_harmless_noise():
    output = [
        ("/x/celery/platforms.py:841: SecurityWarning: You're running the worker with superuser privileges", False),
        ("12:00:00 I [jobs] jobs ready", False),
        ("12:00:01 W [trainer] /x/verl/workers/engine/__init__.py:32: torchtitan engine is not available", False),
        ("12:00:01 W [trainer] Replacing already-initialised platform 'cpu' with 'cpu'", False),
        ("  warnings.warn(...)", False),  # the rest of a hidden warning stays hidden
        ("12:00:02 W [controller] run 3a52: 12 samples older than max_staleness dropped", True),
        ("12:00:03 E [trainer] step failed", True),
        ("Traceback (most recent call last):", True),  # a traceback under an error is shown whole
        ('  File "x.py", line 1, in <module>', True),
        ("ValueError: boom", True),
        ("12:00:04 I [trainer] step 3 done", False),
        ("some library banner", False),
        ("12:00:05 C [api] cannot bind port 8000", True),
        ('{"ts": 1.5, "level": "INFO", "service": "api", "msg": "ready"}', False),  # LOG_FORMAT=json
        ('{"ts": 1.5, "level": "ERROR", "service": "api", "msg": "boom"}', True),
    ]
    shown = ConsoleFilter()
    assert [shown(line) for line, _ in output] == [want for _, want in output]


def test_the_console_shows_each_warning_once_and_no_library_output_printed_beside_it():
    """What a rollout worker of a hub model that is not there printed: huggingface_hub's retry warning twice
    (raw through its own handler, then in our format), verl's prints and a loading bar after a warning."""
    now = [0.0]
    shown = ConsoleFilter(clock=lambda: now[0])
    output = [
        ("12:00:00 W [trainer] checkpoint 3 is slow", True),
        ("Monkey patch Qwen2ForCausalLM model forward", False),
        ("Before FSDP, memory allocated (GB): 0.00, memory reserved (GB): 0.00", False),
        ("Loading checkpoint shards: 100%|##########| 2/2 [00:01<00:00]", False),
        ("\rLoading weights:   0%|          | 0/20 [00:00<?, ?it/s]\rLoading weights: 100%|#| 20/20", False),
        ("libnuma: Warning: /sys not mounted or invalid. Assuming one node: No such file or directory", False),
        ("[transformers] `torch_dtype` is deprecated! Use `dtype` instead!", False),
        ("Retrying in 1s [Retry 1/5].", False),  # huggingface_hub's own handler: the raw copy
        ("12:00:01 W [rollout-worker] Retrying in 1s [Retry 1/5].", True),
        ("12:00:02 E [rollout-worker] cannot serve run 3a52", True),
        ("Traceback (most recent call last):", True),
        ("  File \"x.py\", line 1, in <module>", True),
        ("", True),
        ("During handling of the above exception, another exception occurred:", True),
        ("huggingface_hub.errors.RepositoryNotFoundError: 404 Client Error", True),
        ("12:00:03 E [rollout-worker] cannot serve run 3a52", False),  # the same error for the next task
        ("Traceback (most recent call last):", False),  # with its traceback
        ("12:00:04 W [rollout-worker] Retrying in 1s [Retry 1/5].", False),
    ]
    assert [shown(line) for line, _ in output] == [want for _, want in output]
    now[0] = 61.0  # a minute later the same error is news again
    assert shown("12:01:05 E [rollout-worker] cannot serve run 3a52")
    assert shown('{"ts": 1.5, "level": "ERROR", "service": "api", "msg": "boom"}')
    assert not shown('{"ts": 2.5, "level": "ERROR", "service": "api", "msg": "boom"}')
