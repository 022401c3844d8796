"""The escape suite (tests/support/sandbox_escapes.py): every hostile program is contained by the namespaces mode,
also where /proc/sys is read-only (a container: no --disable-userns, the seccomp filter alone refuses nested
user namespaces), and the tests show which of them get out of mode `none` (the audit-hook guard), so the suite
can fail."""

import dataclasses
import json
import os
import shutil
import subprocess
import sys

import pytest

from services.env_worker.sandbox import ns as sandbox_ns
from tests.support.sandbox_escapes import ESCAPES, Target, proc_sys_read_only

# Out of mode `none` whatever uid the worker has: its guard is a hook inside the program's own interpreter.
LEGACY_ESCAPES = {
    "audit hook switched off by introspection, then a host file read",
    "_posixsubprocess re-imported (its fork_exec raises no audit event)",
    "/proc/self/mem: write into the interpreter's own memory, then read a host file",
    "/proc/<parent>/environ: the worker's secrets", "/proc/<parent>/cmdline: the worker's command line",
    "read the worker's files", "read the repository", "read another session's work dir",
    "write outside the work dir", "symlink to a host file", "hard link to a host file",
    "signal a worker process", "background process left behind", "fill the disk",
}
# And these, when the worker runs as root (mode `none` then runs the program as root).
LEGACY_ESCAPES_AS_ROOT = {"setuid binary: mount as root", "raw socket", "network: connect to the worker's host",
                          "fork bomb", "unshare a user namespace and mount",
                          "nested user namespace: clone and clone3 with CLONE_NEWUSER"}
NAMESPACE_ESCAPES = [e for e in ESCAPES if "namespace" in e.name]


@pytest.fixture(scope="module")
def target():
    with Target() as t:
        yield t


def test_the_suite_covers_at_least_twenty_techniques():
    assert len(ESCAPES) >= 20 and len({e.name for e in ESCAPES}) == len(ESCAPES)
    assert LEGACY_ESCAPES | LEGACY_ESCAPES_AS_ROOT <= {e.name for e in ESCAPES}


@pytest.mark.parametrize("escape", ESCAPES, ids=lambda e: e.name)
def test_namespaces_contain_it(target, escape):
    outcome = target.attempt(escape, "namespaces")
    assert outcome.contained, f"{escape.name}: {outcome.evidence}\n{outcome.result.stdout[-500:]}"


@pytest.mark.parametrize("escape", [e for e in ESCAPES if e.name in LEGACY_ESCAPES
                                    or (os.geteuid() == 0 and e.name in LEGACY_ESCAPES_AS_ROOT)],
                         ids=lambda e: e.name)
def test_the_audit_hook_guard_does_not_contain_it(target, escape):
    outcome = target.attempt(escape, "none")
    assert not outcome.contained, f"{escape.name} was contained by mode none: the suite no longer shows the gap"


@pytest.mark.parametrize("escape", NAMESPACE_ESCAPES, ids=lambda e: e.name)
def test_without_the_sysctl_the_seccomp_filter_alone_refuses_new_namespaces(target, escape, monkeypatch):
    """The layout used where bwrap cannot write /proc/sys/user/max_user_namespaces (no --disable-userns)."""
    lay = dataclasses.replace(sandbox_ns.layout(), userns_sysctl=False)
    monkeypatch.setattr(sandbox_ns, "layout", lambda: lay)
    assert "--disable-userns" not in sandbox_ns.bwrap_argv(lay, {}, [], 1 << 20)
    outcome = target.attempt(escape, "namespaces")
    assert outcome.contained, f"{escape.name}: {outcome.evidence}\n{outcome.result.stdout[-500:]}"
    if "clone3" in escape.name:
        assert "clone refused: Operation not permitted" in outcome.result.stdout, outcome.result.stdout


@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("unshare"), reason="needs root to remount /proc/sys")
def test_where_proc_sys_is_read_only_the_sandbox_starts_and_contains_every_escape():
    """As in a container (the issue that made the compose env worker crash-loop): the start-up check picks the
    layout without the sysctl and without /proc, and the whole suite, run in there, gets nothing out."""
    proc = subprocess.run(proc_sys_read_only([sys.executable, "-m", "tests.support.sandbox_escapes"]),
                          capture_output=True, text=True, timeout=600)
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert summary["userns_sysctl"] is False and summary["proc"] is False, summary
    assert proc.returncode == 0 and summary["escaped"] == {} and summary["contained"] == len(ESCAPES), summary
