"""Checkpoint storage as a usage count: the byte-seconds a checkpoint held in each UTC hour."""

from __future__ import annotations

from shared.stores.tinker_usage import USAGE_TTL_S, held_byte_seconds


def test_storage_is_split_at_hour_boundaries():
    hour = 500_000
    start = hour * 3600 + 1800  # half past
    assert held_byte_seconds(10, start, start + 3600) == {hour: 10 * 1800, hour + 1: 10 * 1800}
    assert held_byte_seconds(10, start, start + 2 * 3600 + 60) == {hour: 18_000, hour + 1: 36_000, hour + 2: 18_600}
    assert held_byte_seconds(4, start, start + 1) == {hour: 4}


def test_nothing_held_counts_nothing_and_hours_past_the_kept_window_are_left_out():
    assert held_byte_seconds(0, 0, 7200) == {}
    assert held_byte_seconds(5, 7200, 7200) == {}
    end = 10**9
    got = held_byte_seconds(1, 0, end)
    assert min(got) * 3600 >= end - USAGE_TTL_S - 3600 and sum(got.values()) == USAGE_TTL_S
