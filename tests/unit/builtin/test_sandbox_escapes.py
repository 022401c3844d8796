"""The escape suite (harness/sandbox_escapes.py): every hostile program is contained by the namespaces mode,
and the tests show which of them get out of mode `none` (the audit-hook guard), so the suite can fail."""

import os

import pytest

from harness.sandbox_escapes import ESCAPES, Target

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
                          "fork bomb", "unshare a user namespace and mount"}


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
