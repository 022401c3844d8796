"""The collection order xdist hands modules out in: modules of `slow` tests first, each whole and in order."""

from __future__ import annotations

from types import SimpleNamespace

from tests.conftest import slow_modules_first


def item(path: str, name: str, slow: bool = False):
    return SimpleNamespace(path=path, name=name, get_closest_marker=lambda m: object() if slow and m == "slow" else None)


def test_modules_of_slow_tests_come_first_whole_and_in_their_order():
    items = [item("a.py", "a1"), item("a.py", "a2"), item("b.py", "b1"), item("b.py", "b2", slow=True),
             item("c.py", "c1"), item("d.py", "d1", slow=True), item("d.py", "d2")]
    assert [i.name for i in slow_modules_first(items)] == ["b1", "b2", "d1", "d2", "a1", "a2", "c1"]
