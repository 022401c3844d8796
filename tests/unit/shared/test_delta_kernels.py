"""The compiled loops of weight deltas (shared/weights/kernels.py) against numpy's slow but obvious answer: every
element width, sizes that do not fill a whole 8-byte word, sparse and dense changes, and malformed positions
that must leave the tensor as it was."""

from __future__ import annotations

import numpy as np
import pytest

from shared.weights.kernels import GAP_DTYPES, PatchError, changes, patch, unpatch


def _reference(old: np.ndarray, new: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    idx = np.flatnonzero(old != new)
    return np.diff(idx, prepend=0), new[idx]


@pytest.mark.parametrize("dtype", [np.int8, np.int16, np.int32, np.int64])
@pytest.mark.parametrize("size", [1, 7, 8, 1001, 65_539])
@pytest.mark.parametrize("share", [0.0, 0.003, 0.06, 0.5, 1.0])
def test_changes_finds_exactly_the_changed_elements(dtype, size, share):
    rng = np.random.default_rng(size)
    old = rng.integers(np.iinfo(dtype).min, np.iinfo(dtype).max, size, dtype=dtype, endpoint=True)
    new = old.copy()
    hit = rng.random(size) < share
    new[hit] ^= dtype(1)  # one flipped bit: the smallest change there is
    found = changes(old, new)
    want_gaps, want_vals = _reference(old, new)
    if want_gaps.size == 0:
        assert found is None
        return
    gaps, vals = found
    assert gaps.dtype == next(d for d in GAP_DTYPES if want_gaps.max() <= np.iinfo(d).max)
    assert np.array_equal(gaps.astype(np.int64), want_gaps) and np.array_equal(vals, want_vals)
    assert vals.dtype == new.dtype


def test_changes_compares_bits_not_values():
    import torch

    old = torch.tensor([float("nan"), 0.0, 1.0, -2.0] * 3, dtype=torch.bfloat16)
    new = old.clone()
    new[1] = -0.0  # equal as a float, other bits
    new[5] = -0.0
    old_bits, new_bits = old.view(torch.int16).numpy(), new.view(torch.int16).numpy()
    gaps, vals = changes(old_bits, new_bits)  # the NaNs (same bits) are not changes
    assert np.cumsum(gaps).tolist() == [1, 5] and vals.tolist() == [new_bits[1], new_bits[5]]


def test_the_first_gap_counts_from_index_zero():
    old = np.zeros(5, np.int16)
    new = old.copy()
    new[[0, 4]] = 1
    gaps, _ = changes(old, new)
    assert gaps.dtype == np.uint8 and gaps.tolist() == [0, 4]


def test_patch_writes_the_changes_and_unpatch_puts_back_what_they_replaced():
    rng = np.random.default_rng(0)
    old = rng.integers(-(2**15), 2**15 - 1, 10_000, dtype=np.int16)
    new = old.copy()
    new[rng.random(old.size) < 0.05] += 1
    gaps, vals = changes(old, new)
    live = old.copy()
    replaced = patch(live, gaps, vals)
    assert np.array_equal(live, new)
    unpatch(live, gaps, replaced)
    assert np.array_equal(live, old)


@pytest.mark.parametrize("gaps", [
    np.array([3, 10], np.uint8),  # the second change at 13: past the end
    np.array([2, 0], np.uint16),  # the same position twice
    np.array([2, -1], np.int32),  # going backwards
    np.array([11], np.int64),
])
def test_malformed_positions_are_refused_and_leave_the_tensor_unchanged(gaps):
    live = np.arange(10, dtype=np.int16)
    with pytest.raises(PatchError, match="outside the tensor"):
        patch(live, gaps, np.full(gaps.size, -7, np.int16))
    assert np.array_equal(live, np.arange(10, dtype=np.int16))


def test_positions_and_values_that_do_not_match_are_refused():
    live = np.arange(10, dtype=np.int16)
    with pytest.raises(PatchError, match="2 positions for 1 values"):
        patch(live, np.array([1, 1], np.uint8), np.array([5], np.int16))
    with pytest.raises(PatchError, match="not 1-d"):
        patch(live, np.array([1.0]), np.array([5], np.int16))
    with pytest.raises(PatchError, match="int32"):
        patch(live, np.array([1], np.uint8), np.array([5], np.int32))  # values of another width than the tensor
    assert np.array_equal(live, np.arange(10, dtype=np.int16))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16", "int8", "float64"])
@pytest.mark.parametrize("share", [0.0, 0.002, 0.3, 1.0])
def test_the_diff_on_the_weights_device_encodes_what_the_host_kernel_does(dtype, share):
    """`changes_on_device` (torch, where the trainer's weights live) gives the same (gaps, values) as `changes`
    over the integer views of the same bits; run here on CPU tensors, on a GPU by `make gpu-smoke`."""
    import torch

    from shared.weights.kernels import changes_on_device

    g = torch.Generator().manual_seed(7)
    size = 70_001  # gaps past a uint8's range at the sparse share
    old = (torch.randn(size, generator=g) * 50).to(getattr(torch, dtype))
    new = old.clone()
    hit = torch.rand(size, generator=g) < share
    bits = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[new.element_size()]
    new.view(bits)[hit] ^= 1  # one flipped bit, as a tiny optimizer step would
    on_device = changes_on_device(old, new)
    host = changes(old.view(bits).numpy(), new.view(bits).numpy())
    if host is None:
        assert on_device is None
        return
    assert on_device is not None
    (dev_gaps, dev_vals), (host_gaps, host_vals) = on_device, host
    assert dev_gaps.dtype == host_gaps.dtype and np.array_equal(dev_gaps, host_gaps)
    assert np.array_equal(dev_vals, host_vals)
