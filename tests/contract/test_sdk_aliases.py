"""The user SDK moved to shared.sdk; `shared.agent` and `shared.types` stay importable for one release: each
warns (DeprecationWarning) and hands out the very same classes."""

from __future__ import annotations

import importlib
import sys
import warnings

import pytest

import shared.sdk.agent
import shared.sdk.types


@pytest.mark.parametrize(("old", "new", "names"), [
    ("shared.agent", shared.sdk.agent, ["BaseAgent", "BaseEnv", "Workflow", "WorkflowTerminated", "Trajectory"]),
    ("shared.types", shared.sdk.types, ["Step", "Trajectory", "Episode", "Action", "TerminationReason"]),
])
def test_the_old_path_warns_and_is_the_same_class(old, new, names):
    sys.modules.pop(old, None)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        alias = importlib.import_module(old)
    assert any(issubclass(w.category, DeprecationWarning) and new.__name__ in str(w.message) for w in caught)
    for name in names:
        assert getattr(alias, name) is getattr(new, name), name
