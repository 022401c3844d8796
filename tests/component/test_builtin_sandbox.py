"""Sandbox behaviour in each mode: each hostile program ends as a result, never a dead or hung caller. Tests
that take `mode` run under both `namespaces` and `none`; those about the audit hook's own refusals run under
`none` (what contains hostile programs is tests/component/test_sandbox_escapes.py)."""

import os
import socket
import uuid

import pytest

from services.env_worker.sandbox import (
    TRUNCATED,
    SandboxLimits,
    SandboxResult,
    SandboxUnavailable,
    check_mode,
    run_python,
)
from services.env_worker.sandbox import ns as sandbox_ns

LIMITS = SandboxLimits(wall_s=5, cpu_s=2, memory_bytes=512 << 20, output_bytes=4096)


@pytest.fixture(params=["namespaces", "none"])
def mode(request):
    return request.param


def test_ordinary_program_runs_and_returns_stdout(mode):
    result = run_python("print(sum(range(10)))", limits=LIMITS, mode=mode)
    assert result.ok and result.stdout == "45\n"


def test_infinite_loop_is_stopped_by_the_cpu_limit(mode):
    result = run_python("while True:\n    pass", limits=LIMITS, mode=mode)
    assert not result.ok and result.error


def test_sleeping_program_is_killed_at_the_wall_limit(mode):
    result = run_python("import time\ntime.sleep(60)", limits=SandboxLimits(wall_s=1), mode=mode)
    assert result.timed_out and result.error == "timed out (wall-clock limit)"


def test_fork_bomb_is_refused():
    result = run_python("import os\nwhile True:\n    os.fork()", limits=LIMITS, mode="none")
    assert not result.ok and "not allowed" in result.error


def test_subprocess_is_refused():
    result = run_python("import subprocess\nsubprocess.run(['true'])", limits=LIMITS, mode="none")
    assert not result.ok and "not allowed" in result.error


def test_memory_bomb_fails_with_memory_error(mode):
    result = run_python("x = bytearray(8 << 30)", limits=LIMITS, mode=mode)
    assert not result.ok and "MemoryError" in result.error


def test_network_connect_is_refused(mode):
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    port = server.getsockname()[1]
    code = f"import socket\ns = socket.create_connection(('127.0.0.1', {port}), timeout=1)\nprint('connected')"
    result = run_python(code, limits=LIMITS, mode=mode)
    server.close()
    assert not result.ok and "connected" not in result.stdout


def test_write_outside_temp_dir_is_refused_and_inside_allowed(tmp_path, mode):
    target = tmp_path / f"escape-{uuid.uuid4().hex}"
    result = run_python(f"open({str(target)!r}, 'w').write('x')", limits=LIMITS, mode=mode)
    assert not result.ok and not target.exists()
    result = run_python("open('local.txt', 'w').write('hi')\nprint(open('local.txt').read())", limits=LIMITS, mode=mode)
    assert result.ok and result.stdout == "hi\n"


def test_killing_the_parent_is_refused():
    result = run_python("import os, signal\nos.kill(os.getppid(), signal.SIGKILL)", limits=LIMITS, mode="none")
    assert not result.ok and os.getpid() > 0


def test_huge_output_is_capped(mode):
    result = run_python("import sys\nwhile True:\n    sys.stdout.write('x' * 65536)", limits=LIMITS, mode=mode)
    assert result.truncated and len(result.stdout) < 4096 + 100


def test_numpy_still_imports(mode):
    result = run_python("import numpy\nprint(numpy.arange(4).sum())", limits=LIMITS, mode=mode)
    assert result.ok and result.stdout.strip() == "6"


def test_read_outside_temp_dir_is_refused(tmp_path):
    secret = tmp_path / "secret.txt"
    secret.write_text("api-token")
    for path in (secret, "/etc/passwd", os.path.abspath(__file__)):
        result = run_python(f"print(open({str(path)!r}).read())", limits=LIMITS, mode="none")
        assert not result.ok and "reading" in result.error and "not allowed" in result.error, path
        assert "api-token" not in result.stdout


def test_listing_outside_temp_dir_is_refused_and_inside_allowed():
    result = run_python("import os\nprint(os.listdir('/root'))", limits=LIMITS, mode="none")
    assert not result.ok and "listing" in result.error
    inside = run_python("import os\nopen('a.txt', 'w').write('x')\nprint(sorted(os.listdir('.')))",
                        limits=LIMITS, mode="none")
    assert inside.ok and "a.txt" in inside.stdout


def test_deep_recursion_is_an_error_not_a_crash_of_the_caller(mode):
    code = "import sys\nsys.setrecursionlimit(10**7)\ndef f(n):\n    return f(n + 1)\nf(0)"
    result = run_python(code, limits=LIMITS, mode=mode)
    assert not result.ok and result.error  # RecursionError or a stack overflow signal, contained


def test_background_process_cannot_outlive_the_call(tmp_path):
    marker = tmp_path / "alive"
    code = (
        "import os, threading, time\n"
        "try:\n"
        "    pid = os.fork()\n"
        "except PermissionError as e:\n"
        "    print('refused:', e)\n"
        "def linger():\n"
        "    time.sleep(3)\n"
        f"    open({str(marker)!r}, 'w').write('still here')\n"
        "threading.Thread(target=linger, daemon=False).start()\n"
        "os.setsid() if hasattr(os, 'setsid') else None\n"
    )
    result = run_python(code, limits=SandboxLimits(wall_s=1, cpu_s=2), mode="none")
    assert "refused:" in result.stdout  # no second process at all
    import time

    time.sleep(3.5)
    assert not marker.exists()  # the lingering thread died with the killed process group


def test_sandbox_reports_each_hostile_program_without_harming_the_worker():
    """The issue's list, end to end: every program returns a result with an error, and this process is fine."""
    programs = {
        "infinite loop": "while True: pass",
        "fork bomb": "import os\nwhile True: os.fork()",
        "memory bomb": "x = ' ' * (8 << 30)",
        "deep recursion": "import sys\nsys.setrecursionlimit(10**7)\ndef f(): f()\nf()",
        "network": "import socket\nsocket.create_connection(('1.1.1.1', 53), timeout=1)",
        "read outside": "open('/etc/hostname').read()",
        "write outside": "open('/tmp/fw-sandbox-escape', 'w').write('x')",
        "huge output": "print('x' * (64 << 20))",
        "sleep past timeout": "import time\ntime.sleep(30)",
        "background process": "import subprocess\nsubprocess.Popen(['sleep', '60'])",
        "signal the parent": "import os\nos.kill(os.getppid(), 9)",
    }
    for name, code in programs.items():
        result = run_python(code, limits=SandboxLimits(wall_s=2, cpu_s=2, memory_bytes=512 << 20,
                                                      output_bytes=4096), mode="none")
        assert not result.ok and result.error, name
    assert not os.path.exists("/tmp/fw-sandbox-escape")


def test_namespaced_program_sees_only_its_sandbox(tmp_path):
    """uid 65534 without capabilities, an empty environment, its own PID namespace, no worker files."""
    (tmp_path / "secret").write_text("x")
    code = ("import os\nstatus = open('/proc/self/status').read()\n"
            "print(os.getuid(), [l.split()[1] for l in status.splitlines() if l.startswith(('CapEff', 'Seccomp:'))],"
            " sorted(os.environ), sorted(p for p in os.listdir('/proc') if p.isdigit()), os.path.exists("
            f"{str(tmp_path)!r}), os.path.exists('/etc/passwd'), os.getcwd())")
    os.environ["FW_TEST_TOKEN"] = "t0ken"
    try:
        result = run_python(code, limits=LIMITS)
    finally:
        del os.environ["FW_TEST_TOKEN"]
    assert result.ok, result.stderr
    assert result.stdout.split(" [")[0] == "65534"
    assert "['0000000000000000', '2']" in result.stdout  # no capabilities; a seccomp filter
    assert "FW_TEST_TOKEN" not in result.stdout and "['1', '2'] False False /sandbox" in result.stdout
    assert "'OPENBLAS_NUM_THREADS'" in result.stdout  # one BLAS thread: imports never hit max_procs


def test_namespaced_program_may_start_processes_and_they_end_with_it():
    code = "import subprocess\nprint(subprocess.run(['echo', 'hi'], capture_output=True, text=True).stdout)"
    result = run_python(code, limits=LIMITS)
    assert result.ok and result.stdout.strip() == "hi"


def test_unknown_mode_and_container_mode_without_image_are_refused_with_the_reason():
    with pytest.raises(ValueError, match="unknown sandbox mode 'nsjail'"):
        check_mode("nsjail")
    with pytest.raises(ValueError, match="needs the env arg `image`"):
        run_python("print(1)", mode="container")


def test_missing_bubblewrap_fails_the_check_with_the_fix(monkeypatch):
    monkeypatch.setattr(sandbox_ns.shutil, "which", lambda name: None)
    with pytest.raises(SandboxUnavailable, match="apt-get install bubblewrap"):
        sandbox_ns._layout()


def test_memory_of_the_whole_process_tree_is_capped_where_a_memory_cgroup_is_there():
    """RLIMIT_AS is per process; a root worker's sandbox also gets a memory cgroup: 3 children of 200 MB each
    under memory_bytes 256 MB (cgroup: 256 + 3 x 32 MB) cannot all live at once."""
    if "memory" not in dict(sandbox_ns.layout().cgroups):
        pytest.skip("no writable memory cgroup here (non-root worker): the bound is RLIMIT_AS per process")
    code = ("import os, time\nkids = []\nfor i in range(3):\n    pid = os.fork()\n    if pid == 0:\n"
            "        b = bytearray(200 << 20)\n        time.sleep(1)\n        os._exit(0)\n    kids.append(pid)\n"
            "print('survived', sum(os.waitpid(k, 0)[1] == 0 for k in kids))")
    result = run_python(code, limits=SandboxLimits(memory_bytes=256 << 20, disk_bytes=32 << 20, wall_s=30))
    assert result.ok and result.stdout.strip() in ("survived 0", "survived 1"), result


@pytest.mark.parametrize("stderr, truncated, reason", [
    ("Traceback (most recent call last):\n  File \"main.py\", line 1\nValueError: bad\n", False, "ValueError: bad"),
    ("the tests did not run to their end", False, "the tests did not run to their end"),
    # a fork bomb's children, killed mid-write: the last line is a frame of another child's traceback
    ("BlockingIOError: [Errno 11] Resource temporarily unavailable\nTraceback (most recent call last):\n"
     "    exec(compile(source, 'main.py', 'exec'))\n", False, "BlockingIOError: [Errno 11] Resource temporarily unavailable"),
    ("OSError: x\nTraceback (most recent call last):\n  File" + TRUNCATED, True, "OSError: x"),
    ("spam\nspam" + TRUNCATED, True, "[output truncated]"),
    ("", False, "exit code 1"),
])
def test_the_one_line_reason_is_the_exception_even_when_the_output_was_cut_or_interleaved(stderr, truncated, reason):
    assert SandboxResult("", stderr, 1, False, truncated, 0.1).error == reason
