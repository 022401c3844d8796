"""Sandbox containment: each hostile program ends as an error result, never a dead or hung caller."""

import os
import socket
import uuid

from shared.builtin.sandbox import SandboxLimits, run_python

LIMITS = SandboxLimits(wall_s=5, cpu_s=2, memory_bytes=512 << 20, output_bytes=4096)


def test_ordinary_program_runs_and_returns_stdout():
    result = run_python("print(sum(range(10)))", limits=LIMITS)
    assert result.ok and result.stdout == "45\n"


def test_infinite_loop_is_stopped_by_the_cpu_limit():
    result = run_python("while True:\n    pass", limits=LIMITS)
    assert not result.ok and result.error


def test_sleeping_program_is_killed_at_the_wall_limit():
    result = run_python("import time\ntime.sleep(60)", limits=SandboxLimits(wall_s=1))
    assert result.timed_out and result.error == "timed out (wall-clock limit)"


def test_fork_bomb_is_refused():
    result = run_python("import os\nwhile True:\n    os.fork()", limits=LIMITS)
    assert not result.ok and "not allowed" in result.error


def test_subprocess_is_refused():
    result = run_python("import subprocess\nsubprocess.run(['true'])", limits=LIMITS)
    assert not result.ok and "not allowed" in result.error


def test_memory_bomb_fails_with_memory_error():
    result = run_python("x = bytearray(8 << 30)", limits=LIMITS)
    assert not result.ok and "MemoryError" in result.error


def test_network_connect_is_refused():
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    port = server.getsockname()[1]
    code = f"import socket\ns = socket.create_connection(('127.0.0.1', {port}), timeout=1)\nprint('connected')"
    result = run_python(code, limits=LIMITS)
    server.close()
    assert not result.ok and "connected" not in result.stdout


def test_write_outside_temp_dir_is_refused_and_inside_allowed(tmp_path):
    target = tmp_path / f"escape-{uuid.uuid4().hex}"
    result = run_python(f"open({str(target)!r}, 'w').write('x')", limits=LIMITS)
    assert not result.ok and not target.exists()
    result = run_python("open('local.txt', 'w').write('hi')\nprint(open('local.txt').read())", limits=LIMITS)
    assert result.ok and result.stdout == "hi\n"


def test_killing_the_parent_is_refused():
    result = run_python("import os, signal\nos.kill(os.getppid(), signal.SIGKILL)", limits=LIMITS)
    assert not result.ok and os.getpid() > 0


def test_huge_output_is_capped():
    result = run_python("import sys\nwhile True:\n    sys.stdout.write('x' * 65536)", limits=LIMITS)
    assert result.truncated and len(result.stdout) < 4096 + 100


def test_numpy_still_imports():
    result = run_python("import numpy\nprint(numpy.arange(4).sum())", limits=LIMITS)
    assert result.ok and result.stdout.strip() == "6"
